"""Every job of every preset in conf/experiment/ gets what its variant file says (issue 13,
item 2): each job composed with Hydra as the sweep composes it, without training."""

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from runner.cli import CONF_DIR
from runner.config import register_configs, validate
from runner.track.tracker import flatten

PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
# The effective batch (data.batch_size x accum) each preset's comment promises for every job:
# its ratios compare techniques, not batch sizes. A new preset must say its own here.
EFFECTIVE_BATCH = {"memory_study": 16, "architectures": 16}


def _compose(overrides: list[str]) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def preset_jobs(preset: str) -> list[list[str]]:
    """Each job's overrides, built as Hydra's basic sweeper builds them: the preset's sweeper
    params first, then the command line (this order is what let the preset beat +variant)."""
    params = _compose([f"+experiment={preset}"]).hydra.sweeper.params
    line = [f"{key}={value}" for key, value in params.items()] + [f"+experiment={preset}"]
    (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(line), None)
    return jobs


JOBS = [(preset, job) for preset in PRESETS for job in preset_jobs(preset)]
IDS = [f"{preset}:{' '.join(job[:-1])}" for preset, job in JOBS]


def _variant_files(job: list[str]) -> list[str]:
    """The conf/variant/ options a job's overrides pick."""
    picked = [o.split("=", 1) for o in job]
    return [option for key, option in picked if key.lstrip("+") == "variant"]


def test_every_preset_is_a_sweep_with_a_promised_batch():
    assert PRESETS and set(PRESETS) == set(EFFECTIVE_BATCH)
    for preset in PRESETS:
        assert len(preset_jobs(preset)) > 1


@pytest.mark.parametrize(("preset", "job"), JOBS, ids=IDS)
def test_each_job_gets_every_key_its_variant_sets(preset, job):
    cfg = _compose(job)
    variants = _variant_files(job)
    assert variants, f"{preset}: job {job} picks no variant"
    for option in variants:
        body = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "variant" / f"{option}.yaml"))
        for entry in body.pop("defaults", []):  # `override /precision: bf16` and the like
            if isinstance(entry, dict):
                ((key, choice),) = entry.items()
                group = key.removeprefix("override ").strip("/ ")
                assert cfg.hydra.runtime.choices[group] == choice, (option, group)
        for key, value in flatten(body).items():
            assert OmegaConf.select(cfg, key) == value, f"variant {option} sets {key}={value}"


@pytest.mark.parametrize(("preset", "job"), JOBS, ids=IDS)
def test_each_job_trains_at_the_presets_effective_batch(preset, job):
    cfg = _compose(job)
    validate(cfg)
    assert cfg.data.batch_size * cfg.accum == EFFECTIVE_BATCH[preset], (
        f"batch {cfg.data.batch_size} x accum {cfg.accum}"
    )


def test_memory_study_accumulates_four_micro_batches_of_four():
    (job,) = [j for j in preset_jobs("memory_study") if _variant_files(j) == ["accum4"]]
    cfg = _compose(job)
    assert (cfg.data.batch_size, cfg.accum) == (4, 4)
    # Not a plain run: the isolated child of a sweep job composes it again with this.
    assert _compose([*job, "hydra.mode=RUN"]).data.batch_size == 4


def test_architectures_trains_four_models_on_the_same_job():
    """Each job gets its keras.applications model, ResNet50 first (the baseline), and every
    other key of the job (data, image size, batch, steps, trainer) equal to the others'."""
    cfgs = [_compose([*job, "hydra.mode=RUN"]) for job in preset_jobs("architectures")]
    assert [c.hydra.runtime.choices.model for c in cfgs] == ["keras_app"] * 4
    names = [c.model.name for c in cfgs]
    assert names == ["ResNet50", "MobileNetV2", "MobileNetV3Small", "EfficientNetB0"]
    assert cfgs[0].sweep.baseline == "0" and list(cfgs[0].sweep.varies) == ["model"]
    rest = []
    for cfg in cfgs:
        validate(cfg)
        job = OmegaConf.masked_copy(cfg, sorted(set(cfg) - {"model", "hydra"}))
        rest.append(flatten(OmegaConf.to_container(job, resolve=True)))
    assert all(r == rest[0] for r in rest), [set(r.items()) ^ set(rest[0].items()) for r in rest]
    data = (rest[0]["data.name"], rest[0]["data.image_size"], rest[0]["data.batch_size"])
    assert data == ("digits", 64, 16)
