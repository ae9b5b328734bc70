"""Memory and speed figures: the contract keys, their sources, and that they move the right way."""

import json

import pytest
import tensorflow as tf
from mlflow.tracking import MlflowClient

from runner.core.machine import cache_dir
from runner.measure import cpu_peak
from runner.measure.telemetry import Memory, speed_figures
from runner.report.timeline import timeline_figure
from runner.train import run

CONTRACT = [
    "mem/peak_bytes",
    "mem/build_peak_bytes",
    "mem/first_step_peak_bytes",
    "mem/peak_rss_bytes",
    "mem/estimate_bytes",
    "mem/measured_over_estimate",
    "speed/compile_s",
    "speed/step_time_s_p10",
    "speed/step_time_s_p50",
    "speed/step_time_s_p90",
    "speed/samples_per_s",
    "speed/input_wait_frac",
    "speed/flops_per_step",
    "speed/mfu",
    "params/total",
    "params/trainable",
]
TRANSFORMER_ONLY = ["speed/tokens_per_s", "params/per_layer"]
ESTIMATE_PARTS = [
    "params",
    "gradients",
    "optimizer",
    "accumulation",
    "masks",
    "activations",
    "workspace",
]
HAS_GPU = bool(tf.config.list_physical_devices("GPU"))


def seed_calibration(policy: str = "float32") -> None:
    """Calibrate this machine's CPU peak (for `policy`) and bandwidth once, in the suite's
    shared cache ($TFMEMLAB_CACHE_DIR, set by conftest and inherited by every `python run.py`
    a test starts), so that no job spends seconds of matmuls and copies on them."""
    cpu_peak.peak(cache_dir(), policy)
    cpu_peak.bandwidth(cache_dir())


def check_contract(client: MlflowClient, run_id: str, model: str) -> dict:
    """Every contract key is logged, positive, and the same in MLflow and metrics.json."""
    mlrun = client.get_run(run_id)
    metrics = mlrun.data.metrics
    keys = CONTRACT + (TRANSFORMER_ONLY if model == "transformer" else [])
    for key in keys:
        assert metrics[key] > 0, key
    for part in ESTIMATE_PARTS:
        assert metrics[f"mem/estimate/{part}_bytes"] >= 0
    assert mlrun.data.tags["mem/source"] in ("gpu_allocator", "cpu_bfc_allocator")
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"metrics.json", "memory_timeline.png"} <= artifacts
    local = client.download_artifacts(run_id, "metrics.json")
    with open(local) as f:
        written = json.load(f)
    assert all(written[k] == pytest.approx(metrics[k]) for k in keys)
    assert len(client.get_metric_history(run_id, "mem/current_bytes")) > 0
    return metrics


def test_speed_figures_from_step_times():
    figures = speed_figures(
        [0.5, 0.01, 0.01, 0.03], [2.0, 0.09, 0.19, 0.07], samples_per_step=8, tokens_per_step=8 * 16
    )
    assert figures["speed/compile_s"] == pytest.approx(2.5)
    assert figures["speed/step_time_s_p50"] == pytest.approx(0.10)
    # numpy's linear percentiles of the steady steps 0.10, 0.20, 0.10
    assert figures["speed/step_time_s_p10"] == pytest.approx(0.10)
    assert figures["speed/step_time_s_p90"] == pytest.approx(0.18)
    assert figures["speed/samples_per_s"] == pytest.approx(3 * 8 / 0.4)
    assert figures["speed/tokens_per_s"] == pytest.approx(3 * 128 / 0.4)
    assert figures["speed/input_wait_frac"] == pytest.approx(0.05 / 0.4)


def test_cpu_allocator_stats_are_on():
    mem = Memory("/CPU:0")
    assert mem.source == "cpu_bfc_allocator"
    mem.reset()
    x = tf.random.normal([1024, 1024])  # 4 MiB held while we read
    assert mem.peak() >= x.shape[0] * x.shape[1] * 4


def test_rss_fallback_reads_the_process_peak():
    import numpy as np

    mem = Memory("/CPU:0", source="rss")
    mem.reset()
    block = np.ones(64 * 2**20 // 8)  # 64 MiB, written, so resident
    assert mem.source == "rss" and mem.peak() >= 48 * 2**20
    assert mem.current() >= 48 * 2**20
    del block


def _peak(tiny_cfg, *overrides) -> dict:
    base = [
        "model.h=64",
        "model.heads=4",
        "data.seq_len=64",
        "trainer.max_steps=3",
        "data.train_samples=128",
    ]
    return run(tiny_cfg("transformer", *base, *overrides))


def test_peak_grows_with_batch_and_width(tiny_cfg):
    small = _peak(tiny_cfg, "data.batch_size=8")
    large = _peak(tiny_cfg, "data.batch_size=32")
    wide = _peak(tiny_cfg, "data.batch_size=8", "model.h=128")
    assert large["mem/peak_bytes"] > 1.5 * small["mem/peak_bytes"]
    assert wide["mem/peak_bytes"] > small["mem/peak_bytes"]
    assert large["mem/estimate/activations_bytes"] == 4 * small["mem/estimate/activations_bytes"]


# The default transformer's measured/estimate in a fresh process is checked more tightly
# elsewhere: against XLA's own plan (tests/test_memory_figures.py, within 3%) and, for every
# precision, on jobs drawn at random (tests/test_estimate_draws.py, 0.85-1.15).


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_gpu_run_reports_the_gpu_allocator(tiny_cfg, store):
    result = run(tiny_cfg("transformer", "trainer.device=gpu"))
    client = MlflowClient(tracking_uri=store)
    check_contract(client, result["run_id"], "transformer")
    assert client.get_run(result["run_id"]).data.tags["mem/source"] == "gpu_allocator"


def test_system_metrics_switch_logs_mlflow_system_metrics(tiny_cfg, store):
    cfg = tiny_cfg(
        "transformer",
        "mlflow.system_metrics=true",
        "mlflow.system_metrics_interval_s=0.5",
        "trainer.max_steps=20",
    )
    result = run(cfg)
    metrics = MlflowClient(tracking_uri=store).get_run(result["run_id"]).data.metrics
    assert any(key.startswith("system/") for key in metrics), sorted(metrics)


@pytest.mark.parametrize("first_step", [1, 43])
def test_the_timeline_numbers_a_resumed_runs_steps_from_the_one_after_its_checkpoint(first_step):
    peaks, held = [30 * 2**20, 20 * 2**20, 21 * 2**20], [5 * 2**20] * 3
    fig = timeline_figure(peaks, held, {"estimate": 25 * 2**20}, "job", first_step)
    ax = fig.axes[0]
    peak_line, held_line = ax.lines[:2]
    assert list(peak_line.get_xdata()) == [first_step, first_step + 1, first_step + 2]
    assert list(held_line.get_xdata()) == list(peak_line.get_xdata())
    assert list(peak_line.get_ydata()) == [30, 20, 21]  # MiB
    expected = "(step 1 traces" if first_step == 1 else "(resumed: step 43 traces"
    assert expected in ax.get_xlabel()
