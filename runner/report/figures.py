"""The run's figures: what was measured, beside the analytic estimate, under fixed keys.

The keys are a contract (issue 3): the same names in MLflow and in `metrics.json` in the
run directory, so runs of any model, precision or device compare column by column.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import keras
import tensorflow as tf
from omegaconf import DictConfig

from models.spec import DataSpec
from runner.core.diskfull import writing
from runner.core.machine import cache_dir
from runner.estimate import memory, xla_plan
from runner.estimate.memory import is_cpu_xla
from runner.measure import flops
from runner.measure.history import History
from runner.measure.telemetry import Memory, speed_figures
from runner.report.timeline import timeline_png
from runner.techniques.checkpointing import RematInfo
from runner.track.tracker import Tracker


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
    mem: Memory
    replicas: int = 1  # tf.distribute replicas: throughput counts all of them
    trained: keras.Model | None = None  # what the step called (checkpointing's wrapper)


def _memory(cfg, facts: RunFacts, cpu_xla: bool) -> tuple[dict, str]:
    gpu = memory.on_gpu(facts.device_name)
    planned = None  # where XLA compiled the step: XLA's own plan of it
    if facts.jit and facts.trained is not None:
        planned = xla_plan.Planned(facts.trained, xla_plan.device(gpu), cache_dir())
    parts = memory.estimate_memory(
        facts.model, facts.optimizer, cfg, facts.spec, cpu_xla, facts.remat, gpu, planned
    )
    peak = facts.history.steady_peak
    reserved, reserved_source = facts.mem.reserved()  # one read (nvidia-smi on a GPU)
    figures = {
        "mem/peak_bytes": peak,
        "mem/build_peak_bytes": facts.build_peak,
        "mem/first_step_peak_bytes": facts.history.first_step_peak,
        "mem/peak_reserved_bytes": reserved,
        "mem/pool_grown_bytes": facts.mem.pool_grown,
        "mem/peak_rss_bytes": facts.mem.peak_rss(),
    }
    if parts["total"] is not None:  # None: activations not modelled (estimate.not_modelled)
        figures["mem/estimate_bytes"] = parts["total"]
        figures["mem/measured_over_estimate"] = peak / parts["total"]
        if "xla_plan" not in parts and (bound := memory.bound_bytes(cfg, facts.model, cpu_xla)):
            figures["mem/estimate_bound_bytes"] = bound  # of the estimate, a bound (the note)
    figures.update({f"mem/estimate/{k}_bytes": v for k, v in parts.items() if k != "total"})
    return figures, reserved_source


def estimate_source(parts: dict, cfg, cpu_xla: bool) -> str:
    """Where an estimate's step part came from, for the run's `mem/estimate_source` tag."""
    if "xla_plan" in parts:
        return "xla_plan: XLA's own buffer assignment of the compiled step"
    if cpu_xla and cfg.model.name == "transformer":
        return "fitted: constants fitted to XLA's plans of the transformer (xla_fitted.py)"
    if cpu_xla:
        return "rules: the layer rules, with XLA's kernel copies (CNNs under XLA are not fitted)"
    return "rules: the layer and executor rules (runner/estimate/layer_rules.py, executor_rules.py)"


def memory_parts(figures: dict) -> dict:
    """The estimate's parts among a run's figures, by part name."""
    return {
        k.removeprefix("mem/estimate/").removesuffix("_bytes"): v
        for k, v in figures.items()
        if k.startswith("mem/estimate/")
    }


def _flops(cfg, facts: RunFacts, step_time_s: float) -> tuple[dict[str, float], str]:
    model = flops.model_flops_per_step(facts.model, cfg, facts.spec)
    hardware = flops.hardware_flops_per_step(model, facts.model, cfg, facts.spec, facts.remat)
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    # A run faster than the cached CPU peak makes it calibrate again (an MFU above 1 is
    # impossible); the hardware rate (recomputation included) keeps HFU <= 1 as well.
    achieved = flops.achieved_flops(hardware, step_time_s)
    peak, source = flops.peak_flops(
        facts.device_name, cfg.precision.policy, cache_dir(), tf32, achieved=achieved
    )
    return {
        "speed/flops_per_step": model,
        "speed/hardware_flops_per_step": hardware,  # with checkpointing's recomputation
        "speed/peak_flops": peak,
        "speed/mfu": flops.mfu(model, step_time_s, peak),
        "speed/hfu": flops.mfu(hardware, step_time_s, peak),
    }, source


def collect(cfg: DictConfig, facts: RunFacts) -> tuple[dict[str, float], dict[str, str]]:
    """Every figure of the run, keyed as in the contract, and tags saying where the memory
    figures and the peak FLOP/s came from."""
    samples = cfg.data.batch_size * cfg.accum * facts.replicas
    tokens = samples * facts.spec.seq_len if facts.spec.kind == "tokens" else None
    # XLA on a CPU converts 16-bit compute to float32 (docs/findings.md, "XLA and precision on a
    # CPU"): estimate what runs.
    cpu_xla = is_cpu_xla(facts.jit, facts.device_name)
    history = facts.history
    held, reserved_source = _memory(cfg, facts, cpu_xla)
    figures = {**_params(facts.model), **held}
    figures.update(speed_figures(history.wait_s, history.compute_s, samples, tokens))
    flops, peak_source = _flops(cfg, facts, figures["speed/step_time_s_p50"])
    figures.update(flops)
    figures["train/final_loss"] = history.losses[-1]
    if facts.remat.segments:
        figures["remat/segments"] = facts.remat.segments
    if cfg.precision.loss_scaling:
        figures["precision/skipped_steps"] = history.skipped_steps
    said = (
        None
        if "mem/estimate/xla_plan_bytes" in held
        else memory.estimate_note(cfg, facts.model, cpu_xla)
    )
    sources = {
        **({"mem/estimate_note": said} if said else {}),
        "mem/source": facts.mem.source,
        "mem/estimate_source": estimate_source(memory_parts(held), cfg, cpu_xla),
        "mem/reserved_source": reserved_source,
        "speed/peak_source": peak_source,
    }
    return figures, sources


def publish(
    tracker: Tracker, figures: dict, history: History, run_dir: Path, title: str, tags: dict
) -> None:
    """Log the figures to MLflow and write metrics.json and the memory timeline beside them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tracker.log_metrics(figures, history.last_step)
    tracker.set_tags(tags)
    with writing(run_dir / "metrics.json"):  # a full disk names the file (issue 27)
        (run_dir / "metrics.json").write_text(json.dumps(figures, indent=2, sort_keys=True))
    tracker.log_artifact(run_dir / "metrics.json")
    # Under XLA's plan the gradients are among the step's buffers, not a part of their own.
    parts = ("params", "gradients", "optimizer")
    named = [k for k in parts if f"mem/estimate/{k}_bytes" in figures]
    fixed = sum(figures[f"mem/estimate/{k}_bytes"] for k in named)
    n = int(tags.get("mem/replicas_per_allocator", 1))  # logical CPUs share one allocator
    per = f", x {n} replicas" if n > 1 else ""
    reference = {f"estimate: {' + '.join(named)}{per}": n * fixed}
    if "mem/estimate_bytes" in figures:  # not when activations are not modelled
        reference = {f"estimate (all parts){per}": n * figures["mem/estimate_bytes"], **reference}
    with writing(run_dir / "memory_timeline.png"):
        png = timeline_png(
            history.step_peaks,
            history.current_bytes,
            reference,
            run_dir / "memory_timeline.png",
            title,
            history.first_step,
        )
    tracker.log_artifact(png)


def log_plan(tracker: Tracker, record: dict, run_dir: Path) -> None:
    """accum=auto's decision and its evidence in the run (runner/plan/auto.py): plan/* metrics,
    and plan.json in the run directory and among the run's artifacts."""
    tracker.log_metrics(
        {
            "plan/micro_batch": record["micro_batch"],
            "plan/accum": record["accum"],
            "plan/predicted_peak_bytes": record["predicted_peak_bytes"],
            "plan/budget_bytes": record["budget_bytes"],
        },
        step=0,
    )
    tracker.set_tags({"plan": "accum=auto"})
    path = run_dir / "plan.json"
    with writing(path):
        path.write_text(json.dumps(record, indent=2))
    tracker.log_artifact(path)
