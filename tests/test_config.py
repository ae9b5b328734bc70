"""Every option of every group composes; overrides land where the README says; bad input
is answered with one line, before TensorFlow is imported."""

import dataclasses
import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from runner.cli import CONF_DIR
from runner.config import ConfigError, register_configs, validate
from tests.conftest import REPO, compose_config, run_cli

OPTIONS = sorted((p.parent.name, p.stem) for p in CONF_DIR.glob("*/*.yaml"))


# Groups outside the default list: presets added with +group=option.
ADDED_GROUPS = {"experiment", "variant"}


def test_every_group_has_options():
    groups = {group for group, _ in OPTIONS}
    assert groups == {
        "model",
        "precision",
        "checkpointing",
        "pruning",
        "data",
        "trainer",
        "distribution",
        "deploy",
        *ADDED_GROUPS,
    }


def _varint(n: int) -> bytes:
    out = b""
    while n >= 0x80:
        out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
    return out + bytes([n])


def _field(number: int, body: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(body)) + body


def _data_files(option: str, folder) -> list[str]:
    """Files for the data options that read them (written without TensorFlow: a TFRecord of
    one tf.train.Example of 65 tokens, its CRCs left 0, which the checks do not read)."""
    if option == "tfrecord":
        tokens = _field(1, b"".join(_varint(t % 100) for t in range(65)))  # Int64List, packed
        entry = _field(1, b"tokens") + _field(2, _field(3, tokens))  # name, Feature.int64_list
        example = _field(1, _field(1, entry))  # Example.features.feature
        record = struct.pack("<Q", len(example)) + bytes(4) + example + bytes(4)
        (folder / "t.tfrecord").write_bytes(record)
        return [f"data.path={folder}/t.tfrecord"]
    if option == "arrays":
        np.savez(folder / "a.npz", x=np.zeros((4, 64), np.int32), y=np.zeros(4, np.int32))
        return [f"data.path={folder}/a.npz"]
    if option == "text":
        (folder / "t.txt").write_text("some text " * 20)
        return [f"data.path={folder}/t.txt"]
    if option == "custom":
        return ["data._target_=runner.config.compose_config"]  # a module that can be found
    return []


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_validates(group, option, tmp_path):
    if group in ADDED_GROUPS:  # presets set keys of the other groups
        validate(compose_config([f"+{group}={option}"]))
        return
    overrides = [f"{group}={option}", *_data_files(option, tmp_path)]
    if option == "image_folder":
        overrides += ["model=mobilenet", f"data.path={tmp_path}"]
    cfg = compose_config(overrides)
    validate(cfg)
    # The option extends its dataclass schema, so typos and wrong types fail at compose time.
    assert dataclasses.is_dataclass(OmegaConf.get_type(cfg[group]))
    if (group, option) == ("model", "keras_app"):  # named after its application
        assert cfg.model.name == "MobileNetV3Small"
    elif group in ("model", "data", "precision"):
        assert cfg[group].name == option


@pytest.mark.parametrize(
    ("overrides", "key", "expected"),
    [
        ([], "accum", 1),
        (["accum=4"], "accum", 4),
        (["precision=mixed"], "precision.policy", "mixed_float16"),
        (["precision=mixed"], "precision.loss_scaling", True),
        (["precision=mixed"], "precision.initial_scale", 2.0**15),
        (["precision=bf16"], "precision.policy", "mixed_bfloat16"),
        (["precision=bf16"], "precision.loss_scaling", False),
        (["model.h=64", "model.heads=8"], "model.h", 64),
        (["model=mobilenet", "model.version=v3_small"], "model.version", "v3_small"),
        (["model=efficientnet", "model.variant=V2S"], "model.variant", "V2S"),
        (["data.batch_size=8"], "data.batch_size", 8),
        (["data=digits"], "data.val_fraction", 0.2),
        (["trainer.optimizer=sgd", "trainer.lr=0.1"], "trainer.lr", 0.1),
        (["trainer.max_steps=null"], "trainer.max_steps", None),
        (["mlflow.experiment=study"], "mlflow.experiment", "study"),
    ],
)
def test_overrides_land_on_keys(overrides, key, expected):
    cfg = compose_config(overrides)
    validate(cfg)
    node = cfg
    for part in key.split("."):
        node = node[part]
    assert node == expected


def test_tracking_uri_defaults_to_sqlite_and_follows_env(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert compose_config([]).mlflow.tracking_uri == "sqlite:///outputs/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert compose_config([]).mlflow.tracking_uri == "http://127.0.0.1:5999"


def test_validate_raises_config_error_naming_key():
    cfg = compose_config(["accum=2"])
    cfg.accum = 0
    with pytest.raises(ConfigError, match=r"^accum=0: .*>= 1"):
        validate(cfg)


BAD_INPUT = [
    (["accum=0"], "accum=0", ">= 1"),
    (["accum=four"], "accum=four", "an integer >= 1, or auto"),
    (["precision=mixd"], "precision=mixd", "bf16, fp32, mixed"),
    (["model.widht=8"], "model.widht=8", "h, heads"),
    (["data.batch_size=-3"], "data.batch_size=-3", ">= 1"),
    (
        ["model=mobilenet", "data=image_folder", "data.path=/no/such/folder"],
        "data.path=/no/such/folder",
        "existing directory",
    ),
    (["model.h=10", "model.heads=4"], "model.h=10", "multiple of model.heads=4"),
    (["-m", "precision=fp32,mixd"], "precision=mixd", "bf16, fp32, mixed"),
    (["trainer.optimizer=adagrad"], "trainer.optimizer=adagrad", "adam, adamw, sgd"),
    # A key the chosen option lacks, given before the choice: the key is named, not the option
    # (Hydra applies group choices first; issue 48 found "data=arrays: no such option").
    (["data.train_samples=32", "data=arrays"], "data.train_samples=32", "x_key, y_key"),
    (["data.train_samples=32", "data=arrays", "precision=mixd"], "precision=mixd", "bf16, fp32"),
    (["sweep.varies=[modle]"], "sweep.varies=modle", "a list of config groups or keys"),
    (["-m", "sweep.repeats=0"], "sweep.repeats=0", "an integer >= 1"),
    (
        ["-m", "sweep.repeats=3", "sweep.isolate=false"],
        "sweep.isolate=False",
        "true with sweep.repeats > 1",
    ),
    (["distribution=parallel"], "distribution=parallel", "mirrored, multi_worker, none"),
    (
        ["distribution=mirrored", "distribution.logical_cpus=1"],
        "distribution.logical_cpus=1",
        "an integer >= 2 with distribution=mirrored",
    ),
    (
        ["distribution.logical_cpus=2"],
        "distribution.logical_cpus=2",
        "an integer >= 2 with distribution=mirrored",
    ),
    (
        ["distribution=multi_worker", "accum=auto"],
        "accum=auto",
        "an integer >= 1 with distribution.strategy=multi_worker",
    ),
    # Each pruning schedule has its own keys (runner/schedules/): a sweep over schedules sets
    # one that some lack with ++, and an override may not turn one schedule into another.
    (
        ["-m", "pruning=none,constant", "pruning.frequency=2"],
        "pruning.frequency=2",
        "++pruning.frequency=2 sets it where a schedule has it",
    ),
    (["pruning=polynomial", "pruning.schedule=m_by_n"], "pruning.schedule=m_by_n", "polynomial"),
    (["deploy=tflite"], "deploy=tflite", "litert, none"),
    (
        ["deploy=litert", "deploy.variants=[float32,int4]"],
        "deploy.variants=int4",
        "a non-empty list of saved_model, float32, float16, dynamic_int8, int8, sparse",
    ),
    (["deploy=litert", "deploy.batch_size=0"], "deploy.batch_size=0", "an integer >= 1"),
    (["deploy=litert", "deploy.threads=0"], "deploy.threads=0", "an integer >= 1"),
    (["deploy=litert", "deploy.rounds=0"], "deploy.rounds=0", "an integer >= 1"),
    (["deploy=litert", "deploy.min_time_s=-1"], "deploy.min_time_s=-1.0", "seconds >= 0"),
    (["deploy=litert", "deploy.threads=two"], "deploy.threads=two", "Integer"),
    (
        ["deploy=litert", "trainer.save_model=false"],
        "trainer.save_model=False",
        "true with deploy=litert",
    ),
]


@pytest.mark.parametrize(
    ("args", "names", "allowed"), BAD_INPUT, ids=[" ".join(a) for a, _, _ in BAD_INPUT]
)
def test_bad_input_fails_in_one_line(args, names, allowed, tmp_path):
    result = run_cli(args, cwd=tmp_path, timeout=60)
    assert result.returncode != 0
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert message.startswith("error: ")
    assert names in message and allowed in message
    assert not (tmp_path / "outputs").exists()  # rejected before any run started


def test_command_line_check_does_not_import_tensorflow_or_mlflow():
    # run.py's imports and its check, as `python run.py accum=four` runs them: a bad value is
    # said in 0.7 s of CPU; with MLflow imported first (by the sweep modules) it took 2.7 s.
    code = (
        "import sys\nimport run\n"
        "run.check_command_line(['precision=mixed', 'accum=4'])\n"
        "heavy = [m for m in ('tensorflow', 'keras', 'mlflow') if m in sys.modules]\n"
        "assert not heavy, f'imported: {heavy}'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_each_data_source_is_checked_without_tensorflow(tmp_path):
    """Every data option's check (its module in runner/data/, named by its YAML) runs before
    TensorFlow loads: a source module's top level imports neither TensorFlow nor numpy."""
    jobs = []
    for option in sorted(p.stem for p in (CONF_DIR / "data").glob("*.yaml")):
        extra = ["model=mobilenet", f"data.path={tmp_path}"] if option == "image_folder" else []
        jobs.append([f"data={option}", *_data_files(option, tmp_path), *extra])
    code = (
        "import importlib, json, sys\n"
        "from runner.config import compose_config, validate\n"
        "for overrides in json.loads(sys.argv[1]):\n"
        "    cfg = compose_config(overrides)\n"
        "    importlib.import_module(cfg.data.module)\n"
        "    assert 'numpy' not in sys.modules, cfg.data.module\n"
        "for overrides in json.loads(sys.argv[1]):\n"
        "    validate(compose_config(overrides))\n"
        "heavy = [m for m in ('tensorflow', 'keras') if m in sys.modules]\n"
        "assert not heavy, f'imported: {heavy}'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(jobs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_each_variant_is_swept_by_one_preset():
    from hydra import compose, initialize_config_dir

    register_configs()
    swept, cfgs = [], {}
    for preset in ("memory_study", "architectures"):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            overrides = [f"+experiment={preset}"]
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
        swept += cfg.hydra.sweeper.params["variant"].split(",")
        cfgs[preset] = cfg
    assert sorted(swept) == sorted(p.stem for p in (CONF_DIR / "variant").glob("*.yaml"))
    cfg = cfgs["memory_study"]
    assert cfg.model.name == "transformer" and cfg.mlflow.experiment == "memory_study"
