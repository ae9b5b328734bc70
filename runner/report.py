"""The run's figures: what was measured, beside the analytic estimate, under fixed keys.

The keys are a contract (issue 3): the same names in MLflow and in `metrics.json` in the
run directory, so runs of any model, precision or device compare column by column.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import keras
from omegaconf import DictConfig

from models.spec import DataSpec
from runner import estimate
from runner.checkpointing import RematInfo
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


@dataclass
class RunFacts:
    """What a finished run hands to the report."""

    model: keras.Model  # as built, before checkpointing wrapped it
    optimizer: keras.optimizers.Optimizer
    spec: DataSpec
    history: History
    build_peak: int
    device_name: str
    jit: bool
    remat: RematInfo


def _memory(cfg, facts: RunFacts, cpu_xla: bool) -> dict:
    parts = estimate.estimate_memory(
        facts.model, facts.optimizer, cfg, facts.spec, cpu_xla, facts.remat
    )
    peak = facts.history.steady_peak
    figures = {
        "mem/peak_bytes": peak,
        "mem/build_peak_bytes": facts.build_peak,
        "mem/first_step_peak_bytes": facts.history.first_step_peak,
        "mem/peak_rss_bytes": Memory.peak_rss(),
        "mem/estimate_bytes": parts["total"],
        "mem/measured_over_estimate": peak / parts["total"],
    }
    figures.update({f"mem/estimate/{k}_bytes": v for k, v in parts.items() if k != "total"})
    return figures


def _flops(cfg, facts: RunFacts, step_time_s: float) -> tuple[dict[str, float], str]:
    flops = estimate.model_flops_per_step(facts.model, cfg, facts.spec)
    hardware = estimate.hardware_flops_per_step(flops, facts.model, cfg, facts.spec, facts.remat)
    peak, source = estimate.peak_flops(facts.device_name, cfg.precision.policy, CACHE_DIR)
    return {
        "speed/flops_per_step": flops,
        "speed/hardware_flops_per_step": hardware,  # with checkpointing's recomputation
        "speed/peak_flops": peak,
        "speed/mfu": estimate.mfu(flops, step_time_s, peak),
        "speed/hfu": estimate.mfu(hardware, step_time_s, peak),
    }, source


def collect(cfg: DictConfig, facts: RunFacts) -> tuple[dict[str, float], str]:
    """Every figure of the run, keyed as in the contract, and where the peak FLOP/s came from."""
    samples = cfg.data.batch_size * cfg.accum
    tokens = samples * facts.spec.seq_len if facts.spec.kind == "tokens" else None
    # XLA on a CPU converts 16-bit compute to float32 (shared GUIDE): estimate what runs.
    name = facts.device_name
    cpu_xla = facts.jit and "GPU" not in name.upper() and "NVIDIA" not in name
    history = facts.history
    figures = {**_params(facts.model), **_memory(cfg, facts, cpu_xla)}
    figures.update(speed_figures(history.wait_s, history.compute_s, samples, tokens))
    flops, peak_source = _flops(cfg, facts, figures["speed/step_time_s_p50"])
    figures.update(flops)
    figures["train/final_loss"] = history.losses[-1]
    if facts.remat.segments:
        figures["remat/segments"] = facts.remat.segments
    if cfg.precision.loss_scaling:
        figures["precision/skipped_steps"] = history.skipped_steps
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
