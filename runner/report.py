"""The run's figures: what was measured, beside the analytic estimate, under fixed keys.

The keys are a contract (issue 3): the same names in MLflow and in `metrics.json` in the
run directory, so runs of any model, precision or device compare column by column.
"""

import json
from pathlib import Path

import keras
from omegaconf import DictConfig

from runner import estimate
from runner.loop import History
from runner.telemetry import Memory, speed_figures, timeline_png
from runner.tracking import Tracker

CACHE_DIR = Path("outputs")  # the calibrated CPU peak is cached here, beside the store


def _params(model: keras.Model) -> dict[str, float]:
    figures = {
        "params/total": model.count_params(),
        "params/trainable": sum(int(v.numpy().size) for v in model.trainable_variables),
    }
    blocks = [layer for layer in model.layers if layer.name.startswith("block_")]
    if blocks and all(hasattr(b, "attn") for b in blocks):  # the transformer's own blocks
        figures["params/per_layer"] = blocks[0].count_params()
    return figures


def _memory(cfg, model, optimizer, spec, history: History, build_peak: int, cpu_xla: bool) -> dict:
    parts = estimate.estimate_memory(model, optimizer, cfg, spec, cpu_xla)
    figures = {
        "mem/peak_bytes": history.steady_peak,
        "mem/build_peak_bytes": build_peak,
        "mem/first_step_peak_bytes": history.first_step_peak,
        "mem/peak_rss_bytes": Memory.peak_rss(),
        "mem/estimate_bytes": parts["total"],
        "mem/measured_over_estimate": history.steady_peak / parts["total"],
    }
    figures.update({f"mem/estimate/{k}_bytes": v for k, v in parts.items() if k != "total"})
    return figures


def collect(
    cfg: DictConfig,
    model,
    optimizer,
    spec,
    history: History,
    build_peak: int,
    device_name: str,
    jit: bool,
) -> tuple[dict[str, float], str]:
    """Every figure of the run, keyed as in the contract, and where the peak FLOP/s came from."""
    samples = cfg.data.batch_size * cfg.accum
    tokens = samples * spec.seq_len if spec.kind == "tokens" else None
    # XLA on a CPU converts 16-bit compute to float32 (shared GUIDE): estimate what runs.
    cpu_xla = jit and "GPU" not in device_name.upper() and "NVIDIA" not in device_name
    figures = {
        **_params(model),
        **_memory(cfg, model, optimizer, spec, history, build_peak, cpu_xla),
    }
    figures.update(speed_figures(history.wait_s, history.compute_s, samples, tokens))
    flops = estimate.model_flops_per_step(model, cfg, spec)
    peak, peak_source = estimate.peak_flops(device_name, cfg.precision.policy, CACHE_DIR)
    figures["speed/flops_per_step"] = flops
    figures["speed/peak_flops"] = peak
    figures["speed/mfu"] = estimate.mfu(flops, figures["speed/step_time_s_p50"], peak)
    figures["train/final_loss"] = history.losses[-1]
    return figures, peak_source


def publish(
    tracker: Tracker, figures: dict, history: History, run_dir: Path, title: str, tags: dict
) -> None:
    """Log the figures to MLflow and write metrics.json and the memory timeline beside them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tracker.log_metrics(figures, len(history.losses))
    tracker.set_tags(tags)
    (run_dir / "metrics.json").write_text(json.dumps(figures, indent=2, sort_keys=True))
    tracker.client.log_artifact(tracker.run_id, str(run_dir / "metrics.json"))
    png = timeline_png(history.current_bytes, run_dir / "memory_timeline.png", title)
    tracker.client.log_artifact(tracker.run_id, str(png))
