"""The run's figures: what was measured, beside the analytic estimate, under fixed keys.

The keys are a contract (issue 3): the same names in MLflow and in `metrics.json` in the
run directory, so runs of any model, precision or device compare column by column.
"""

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import keras
import tensorflow as tf
from omegaconf import DictConfig

from models.spec import DataSpec
from runner.loop import History
from runner.measure import estimate, flops, profile
from runner.measure.telemetry import Memory, speed_figures, timeline_png
from runner.techniques.checkpointing import RematInfo
from runner.techniques.pruning import Pruner, gzip_weights_bytes
from runner.track.tracking import Tracker, WorkerTracker, ui_hint

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
    mem: Memory
    replicas: int = 1  # tf.distribute replicas: throughput counts all of them


def _memory(cfg, facts: RunFacts, cpu_xla: bool) -> tuple[dict, str]:
    parts = estimate.estimate_memory(
        facts.model, facts.optimizer, cfg, facts.spec, cpu_xla, facts.remat
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
        "mem/estimate_bytes": parts["total"],
        "mem/measured_over_estimate": peak / parts["total"],
    }
    figures.update({f"mem/estimate/{k}_bytes": v for k, v in parts.items() if k != "total"})
    return figures, reserved_source


def _flops(cfg, facts: RunFacts, step_time_s: float) -> tuple[dict[str, float], str]:
    model = flops.model_flops_per_step(facts.model, cfg, facts.spec)
    hardware = flops.hardware_flops_per_step(model, facts.model, cfg, facts.spec, facts.remat)
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    # A run faster than the cached CPU peak makes it calibrate again (an MFU above 1 is
    # impossible); the hardware rate (recomputation included) keeps HFU <= 1 as well.
    achieved = flops.achieved_flops(hardware, step_time_s)
    peak, source = flops.peak_flops(
        facts.device_name, cfg.precision.policy, CACHE_DIR, tf32, achieved=achieved
    )
    return {
        "speed/flops_per_step": model,
        "speed/hardware_flops_per_step": hardware,  # with checkpointing's recomputation
        "speed/peak_flops": peak,
        "speed/mfu": flops.mfu(model, step_time_s, peak),
        "speed/hfu": flops.mfu(hardware, step_time_s, peak),
    }, source


def is_cpu_xla(jit: bool, device_name: str) -> bool:
    """Whether XLA compiles the steps for a CPU (device_name: runner.device.describe's)."""
    return jit and "GPU" not in device_name.upper() and "NVIDIA" not in device_name


def collect(cfg: DictConfig, facts: RunFacts) -> tuple[dict[str, float], dict[str, str]]:
    """Every figure of the run, keyed as in the contract, and tags saying where the memory
    figures and the peak FLOP/s came from."""
    samples = cfg.data.batch_size * cfg.accum * facts.replicas
    tokens = samples * facts.spec.seq_len if facts.spec.kind == "tokens" else None
    # XLA on a CPU converts 16-bit compute to float32 (shared GUIDE): estimate what runs.
    cpu_xla = is_cpu_xla(facts.jit, facts.device_name)
    history = facts.history
    memory, reserved_source = _memory(cfg, facts, cpu_xla)
    figures = {**_params(facts.model), **memory}
    figures.update(speed_figures(history.wait_s, history.compute_s, samples, tokens))
    flops, peak_source = _flops(cfg, facts, figures["speed/step_time_s_p50"])
    figures.update(flops)
    figures["train/final_loss"] = history.losses[-1]
    if facts.remat.segments:
        figures["remat/segments"] = facts.remat.segments
    if cfg.precision.loss_scaling:
        figures["precision/skipped_steps"] = history.skipped_steps
    sources = {
        "mem/source": facts.mem.source,
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
    (run_dir / "metrics.json").write_text(json.dumps(figures, indent=2, sort_keys=True))
    tracker.log_artifact(run_dir / "metrics.json")
    fixed = sum(figures[f"mem/estimate/{k}_bytes"] for k in ("params", "gradients", "optimizer"))
    n = int(tags.get("mem/replicas_per_allocator", 1))  # logical CPUs share one allocator
    per = f", x {n} replicas" if n > 1 else ""
    reference = {
        f"estimate (all parts){per}": n * figures["mem/estimate_bytes"],
        f"estimate: params + gradients + optimizer{per}": n * fixed,
    }
    png = timeline_png(
        history.step_peaks,
        history.current_bytes,
        reference,
        run_dir / "memory_timeline.png",
        title,
        history.first_step,
    )
    tracker.log_artifact(png)


# Params that do not change what is trained: a dense baseline may differ in these.
_NOT_COMPARED = ("pruning.", "mlflow.", "trainer.progress")


def _dense_baseline(tracker: Tracker, val_accuracy: float) -> dict[str, float]:
    """The latest finished dense run of this experiment with the same params except pruning.*
    (same model, data, seed and steps): its val/accuracy beside this run's, if there is one.
    None is looked for while the tracking server is lost (Tracker.lost)."""
    if tracker.lost is not None:
        return {}
    client = tracker.client
    run = client.get_run(tracker.run_id)

    def compared(params: dict) -> dict:
        return {k: v for k, v in params.items() if not k.startswith(_NOT_COMPARED)}

    dense_runs = client.search_runs(
        [run.info.experiment_id],
        "params.`pruning.schedule` = 'none' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=200,
    )
    for dense in dense_runs:
        same_job = compared(dense.data.params) == compared(run.data.params)
        if same_job and "val/accuracy" in dense.data.metrics:
            tracker.set_tags({"prune/dense_run_id": dense.info.run_id})
            accuracy = dense.data.metrics["val/accuracy"]
            return {
                "prune/dense_val_accuracy": accuracy,
                "prune/val_accuracy_delta": val_accuracy - accuracy,
            }
    tracker.set_tags({"prune/dense_run_id": "none: run the same job with pruning=none"})
    return {}


def pruning_figures(
    pruner: Pruner | None, tracker: Tracker, run_dir: Path, history: History
) -> dict[str, float]:
    """prune/* figures, with the per-kernel table and the pruned model as artifacts (issue 6);
    none without pruning.

    prune/sparsity: zeros over all pruned kernels. prune/gzip_ratio: the gzip-compressed weights
    file (model.save_weights) of the model as built (dense) over that of the model at the end
    (pruned); embeddings, biases and norms are in both. The model is saved as built (before
    checkpointing wrapped it); its masks live in the Pruner, so nothing needs stripping.
    """
    if pruner is None:
        return {}
    rows = pruner.table()
    run_dir.mkdir(parents=True, exist_ok=True)
    table, model_file = run_dir / "pruning_table.csv", run_dir / "pruned_model.keras"
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    pruner.model.save(model_file)
    for path in (table, model_file):
        tracker.log_artifact(path)
    for step, sparsity in pruner.updates:
        tracker.log_metrics({"prune/scheduled_sparsity": sparsity}, step)
    zeros, size = sum(r["zeros"] for r in rows), sum(r["size"] for r in rows)
    figures = {
        "prune/sparsity": zeros / size,
        "prune/pruned_params": zeros,
        "prune/gzip_ratio": pruner.dense_gzip_bytes / gzip_weights_bytes(pruner.model),
    }
    return {**figures, **_dense_baseline(tracker, history.evals[-1][1]["val/accuracy"])}


def pruning_summary(figures: dict) -> str:
    line = (
        f"  pruned: sparsity {figures['prune/sparsity']:.3f} of the pruned kernels, weights "
        f"file {figures['prune/gzip_ratio']:.2f}x smaller gzipped"
    )
    if "prune/dense_val_accuracy" in figures:
        line += (
            f", dense baseline val/accuracy {figures['prune/dense_val_accuracy']:.4f} "
            f"({figures['prune/val_accuracy_delta']:+.4f})"
        )
    masks = figures["mem/estimate/masks_bytes"] / 2**20
    return line + f"; training memory not lowered (masks +{masks:.2f} MiB)"


# How the summary names mem/peak_reserved_bytes, by mem/reserved_source.
_RESERVED_LABEL = {"rss_delta": "process RSS +", "nvidia_smi": "GPU held ", "none": "held ?"}


def summary(cfg, dev, history, figures, sources, seconds, tracker, notes, table) -> str:
    """The end-of-run summary: printed, and the run's description in the MLflow UI."""
    losses, final = history.losses, history.evals[-1][1]
    lines = [
        f"tfmemlab: model={cfg.model.name} precision={cfg.precision.name} accum={cfg.accum} "
        f"on {dev}: {len(losses)} steps in {seconds:.1f} s"
        + (
            f" (resumed: steps {history.first_step}-{history.last_step}; the figures cover "
            "these only)"
            if history.first_step > 1
            else ""
        ),
        f"  train/loss {losses[0]:.4f} -> {losses[-1]:.4f}   val/loss {final['val/loss']:.4f}"
        f"   val/accuracy {final['val/accuracy']:.4f}",
    ]
    if "prune/sparsity" in figures:
        lines.append(pruning_summary(figures))
    lines.append(
        f"  peak {figures['mem/peak_bytes'] / 2**20:.1f} MiB (estimate "
        f"{figures['mem/estimate_bytes'] / 2**20:.1f} MiB; "
        f"{_RESERVED_LABEL[sources['mem/reserved_source']]}"
        f"{figures['mem/peak_reserved_bytes'] / 2**20:.1f} MiB)   step "
        f"{figures['speed/step_time_s_p50'] * 1e3:.1f} ms p50   "
        f"{figures['speed/samples_per_s']:.1f} samples/s   compile "
        f"{figures['speed/compile_s']:.1f} s"
    )
    if "mem/peak_scope" in sources:  # under tf.distribute; the estimate is one replica's
        lines.append(f"  peak of {sources['mem/peak_scope']}; the estimate is one replica's")
    if table:
        lines += profile.summary_lines(figures, table)
    lines += [f"  note: {note}" for note in notes]
    if isinstance(tracker, WorkerTracker):
        lines.append("  MLflow: this worker's figures are in the chief's run")
        return "\n".join(lines)
    command, url = ui_hint(cfg.mlflow.tracking_uri, tracker.experiment_id, tracker.run_id)
    lines.append(f"  MLflow: run '{tracker.run_name}' in experiment '{cfg.mlflow.experiment}'")
    if command:
        lines.append(f"  open the UI: {command}")
    lines.append(f"  then: {url}")
    return "\n".join(lines)
