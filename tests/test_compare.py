"""The comparison report on runs in a real (temporary) MLflow store: each job labelled by what
differs from the baseline, ratios of unlike jobs marked, child runs renamed, the pictures.

Runs carry the params a real job logs (its composed config, flattened) and figures in the
shape report.py logs them; no training."""

import csv

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from PIL import Image

from runner.config import compose_config
from runner.report import sweep_plots as sweep
from runner.track import compare
from runner.track.tracker import flatten
from tests.test_presets import preset_jobs

MIB = 2**20
STUDY = preset_jobs("memory_study")  # baseline, mixed, bf16, accum4, remat, pruned
LABELS = ["baseline", "mixed", "bf16", "accum=4", "checkpointing=blocks", "pruning=polynomial"]
# (peak MiB, step s, samples/s) per job; bf16 lands on the baseline's spot, as it did on a CPU.
FIGURES = [(200, 1.0, 16.0), (210, 2.0, 8.0), (200, 1.0, 16.0), (150, 4.0, 4.0), (120, 1.3, 12.3)]
FIGURES += [(205, 1.1, 14.5)]
ARCH = preset_jobs("architectures")  # ResNet50, MobileNetV2, MobileNetV3Small, EfficientNetB0
# params/total of each at 10 classes, as the preset's jobs logged them.
ARCH_PARAMS = {"ResNet50": 23_608_202, "MobileNetV2": 2_270_794}
ARCH_PARAMS |= {"MobileNetV3Small": 1_540_218, "EfficientNetB0": 4_062_381}
ARCH_FIGURES = [(472, 0.78, 21.0), (133, 0.22, 66.0), (67, 0.10, 158.0), (201, 0.41, 33.0)]


def _params(overrides: list[str]) -> dict[str, str]:
    """What train.py logs as params: the resolved config, flattened, and derived figures."""
    cfg = compose_config(overrides)
    params = flatten(OmegaConf.to_container(cfg, resolve=True))
    params["effective_batch_size"] = cfg.data.batch_size * cfg.accum
    params["params_total"] = (
        ARCH_PARAMS.get(cfg.model.name) or 12 * cfg.model.h**2 * cfg.model.layers
    )
    params["remat/policy"] = cfg.checkpointing.policy
    return {k: str(v) for k, v in params.items()}


def _metrics(params: dict[str, str], peak: float, step: float, rate: float) -> dict[str, float]:
    parts = {"params": 3.0, "gradients": 3.0, "optimizer": 6.0, "workspace": 10.0}
    parts["accumulation"] = 3.0 if params["accum"] != "1" else 0.0
    parts["masks"] = 3.0 if params["pruning.schedule"] != "none" else 0.0
    parts["activations"] = 100.0 / int(params["accum"])
    metrics = {f"mem/estimate/{k}_bytes": v * MIB for k, v in parts.items()}
    metrics["mem/estimate_bytes"] = sum(parts.values()) * MIB
    return {
        **metrics,
        "mem/peak_bytes": peak * MIB,
        "params/total": float(params["params_total"]),
        "speed/step_time_s_p50": step,
        "speed/samples_per_s": rate,
    }


def _log_job(client, experiment, num: int, overrides: list[str], figures, sweep="s") -> None:
    run = client.create_run(
        experiment, run_name=" ".join(overrides), tags={"job_num": str(num), "sweep_id": sweep}
    )
    params = _params(overrides)
    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run.info.run_id, params=items[i : i + 100])
    metrics = [Metric(k, v, 0, 0) for k, v in _metrics(params, *figures).items()]
    client.log_batch(run.info.run_id, metrics=metrics)
    client.set_terminated(run.info.run_id)


@pytest.fixture
def study(store):
    """A store holding memory_study's six jobs (tiny figures), plus any extra jobs given."""

    def make(*extra: tuple[list[str], tuple]) -> tuple[MlflowClient, list]:
        client = MlflowClient(tracking_uri=store)
        experiment = client.create_experiment("memory_study")
        jobs = list(zip(STUDY, FIGURES, strict=True)) + list(extra)
        for num, (overrides, figures) in enumerate(jobs):
            _log_job(client, experiment, num, overrides, figures)
        runs = client.search_runs([experiment])
        return client, sorted(runs, key=lambda r: int(r.data.tags["job_num"]))

    return make


def test_each_memory_study_job_is_labelled_by_what_differs(study):
    _, runs = study()
    out = compare.rows(runs, "0")
    assert [r["job"] for r in out] == LABELS
    assert [r["differs"] for r in out] == [""] * 6  # like for like: every ratio stands
    assert "*" not in compare.text(out)
    assert out[3]["peak_MiB/base"] == pytest.approx(0.75)


def test_ratios_of_jobs_unlike_the_baseline_are_marked(study, tmp_path):
    old_accum4 = STUDY[3] + ["data.batch_size=16"]  # the bug: 4 micro-batches of 16
    wider = STUDY[0] + ["model.h=128", "data.seq_len=64"]
    _, runs = study((old_accum4, (220, 4.0, 16.0)), (wider, (80, 0.5, 32.0)))
    out = compare.rows(runs, "0")
    assert [r["job"] for r in out[6:]] == [
        "accum=4 effective_batch_size=64",
        "data.seq_len=64 model.h=128",
    ]
    assert [r["differs"] for r in out] == [""] * 6 + [
        "effective_batch_size",
        "data.seq_len model.h params_total",
    ]
    shown = compare.text(out).splitlines()
    assert "1.1*" in shown[7] and "0.4*" in shown[8]  # peak ratio 220/200, 80/200
    assert all("*" not in line for line in shown[1:7])
    assert shown[-1].startswith("(*) not like for like") and "effective_batch_size" in shown[-1]
    markdown = compare.write_markdown(out, tmp_path / "comparison.md").read_text()
    assert "| differs |" in markdown.splitlines()[0] and "1.1*" in markdown
    assert "(*) not like for like" in markdown


def test_a_job_repeating_another_gets_its_job_number(study):
    _, runs = study((STUDY[0], (201, 1.0, 16.0)))
    assert compare.rows(runs, "0")[6]["job"] == "baseline (job 6)"


def test_sweep_names_child_runs_by_their_labels(study):
    from runner.sweep.callback import name_runs

    client, runs = study()
    first = compare.rows(runs, "0")
    name_runs(client, runs, first)
    renamed = [client.get_run(r.info.run_id) for r in runs]
    assert [r.info.run_name for r in renamed] == LABELS
    assert renamed[3].data.tags["overrides"] == "variant=accum4 +experiment=memory_study"
    # The same table afterwards, with the baseline still found by its overrides.
    again = compare.rows(renamed, "variant=baseline +experiment=memory_study")
    assert [r["job"] for r in again] == LABELS and again[0]["peak_MiB/base"] == 1.0


def test_report_files_and_their_pictures(study, tmp_path):
    _, runs = study((STUDY[3] + ["data.batch_size=16"], (220, 4.0, 16.0)))
    out = compare.rows(runs, "0")
    paths = sweep.report_files(out, tmp_path)
    names = {p.name for p in paths}
    assert {"comparison.csv", "comparison.md", "pareto.png", "memory_breakdown.png"} <= names
    for path in paths:
        if path.suffix == ".png":
            assert min(Image.open(path).size) > 200
    with (tmp_path / "comparison.csv").open() as f:
        first = next(csv.DictReader(f))
    assert float(first["est_activations_MiB"]) == 100.0 and first["differs"] == ""


def test_pareto_says_upper_left_and_separates_jobs_on_one_spot(study):
    _, runs = study()
    out = compare.rows(runs, "0")
    ax = sweep.pareto(out).axes[0]
    assert "upper left is better" in ax.get_title()
    labels = {a.get_text(): a for a in ax.texts}
    assert set(labels) == set(LABELS)
    # baseline and bf16 share a point; no label may sit on another.
    assert labels["baseline"].xy == labels["bf16"].xy
    renderer = FigureCanvasAgg(ax.figure).get_renderer()
    for a in ax.texts:
        a.get_window_extent(renderer)
    boxes = [Text.get_window_extent(a) for a in ax.texts]
    assert not any(b.overlaps(c) for i, b in enumerate(boxes) for c in boxes[i + 1 :])
    markers = [c.get_paths()[0].vertices.tobytes() for c in ax.collections]
    assert len(set(markers)) == len(LABELS)


def test_memory_breakdown_stacks_the_estimate_beside_the_peak(study):
    _, runs = study()
    out = compare.rows(runs, "0")
    ax = sweep.memory_breakdown(out).axes[0]
    bars = ax.patches
    assert len(bars) == len(LABELS) * (len(compare.PARTS) + 1)
    top = bars[-len(LABELS) - len(LABELS) : -len(LABELS)]  # the last part, on top of the rest
    tops = [b.get_y() + b.get_height() for b in top]
    # The estimate's total: 3 + 3 + 6 + 10 + 100 MiB; accum=4 adds 3 and keeps 100 / 4.
    assert tops[0] == pytest.approx(122.0) and tops[3] == pytest.approx(50.0)
    assert [b.get_height() for b in bars[-len(LABELS) :]] == [f[0] for f in FIGURES]
    assert [t.get_text() for t in ax.get_xticklabels()] == LABELS
    assert [t.get_text() for t in ax.get_legend().get_texts()][-1] == "measured peak"


def test_architectures_compares_models_on_purpose_and_nothing_else(store):
    """+experiment=architectures' sweep settings (sweep.baseline, sweep.varies), read as the
    sweep's end reads them (runner.sweep.callback.comparison): its models differ on purpose, so
    no ratio is marked; a job at another image size still is."""
    from runner.sweep.callback import comparison

    client = MlflowClient(tracking_uri=store)
    experiment = client.create_experiment("architectures")
    parent = client.create_run(experiment, tags={"sweep": "parent"}).info.run_id
    smaller = (ARCH[1] + ["data.image_size=32"], (60, 0.1, 100.0))
    for num, (job, figures) in enumerate([*zip(ARCH, ARCH_FIGURES, strict=True), smaller]):
        _log_job(client, experiment, num, job, figures, sweep=parent)
    runs, out, deployed = comparison(
        client, parent, compose_config(["+experiment=architectures"]).sweep
    )
    assert deployed == []  # no job measured a deployment
    apps = ["MobileNetV2", "MobileNetV3Small", "EfficientNetB0"]
    assert [r["job"] for r in out[:4]] == [f"model={a}" for a in ["ResNet50 (baseline)", *apps]]
    assert [r["differs"] for r in out] == ["", "", "", "", "data.image_size"]
    assert [r["params_M"] for r in out[:4]] == pytest.approx(
        [n / 1e6 for n in ARCH_PARAMS.values()]
    )
    assert out[3]["peak_MiB/base"] == pytest.approx(201 / 472)
    shown = compare.text(out).splitlines()
    assert all("*" not in line for line in shown[1:5]) and "data.image_size" in shown[-1]
    # Without sweep.varies, every model's ratios are marked unlike the baseline's.
    assert {r["differs"] for r in compare.rows(runs, "0")[1:4]} == {"model.name params_total"}
    # The terminal's table of the same sweep, told what varies: the sweep's own rows.
    again = compare.main(["--sweep", parent, "--tracking-uri", store, "--varies", "model"])
    assert again == out


def test_with_one_run_per_job_the_table_says_there_is_no_interval(study, tmp_path):
    _, runs = study()
    out = compare.rows(runs, "0")
    assert {r["step_s/base_noise"] for r in out} == {"", "no interval"}  # "": the baseline
    assert all(r["step_s/base_lo"] is None for r in out)
    markdown = compare.write_markdown(out, tmp_path / "comparison.md").read_text()
    assert "No intervals: each job ran once (sweep.repeats=1)" in markdown
    assert "[" not in markdown.split("\n\n")[0] and "within noise" not in markdown
