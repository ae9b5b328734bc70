"""`run(cfg) -> dict`: the whole pipeline, top to bottom.

seed -> precision -> data -> model -> techniques (checkpointing, pruning) -> optimizer ->
train loop -> evaluate -> report.
"""

import importlib
import sys
import time
from pathlib import Path

import keras
import tensorflow as tf
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner import device
from runner.config import IMAGE_MODELS, validate
from runner.data import build_data
from runner.loop import evaluate, train
from runner.measure import profile, report
from runner.measure.telemetry import Memory
from runner.step import build_optimizer, make_eval_step, make_train_step, resolve_jit
from runner.techniques import checkpointing, precision, pruning
from runner.track.tracking import log_config, mlflow_run, ui_hint


def _overrides() -> list[str]:
    """The command-line overrides of this job (empty when called outside Hydra)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _run_dir(run_id: str) -> Path:
    """Hydra's output folder for this job, or outputs/runs/<run id> outside Hydra."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path("outputs") / "runs" / run_id


def build_model(cfg: DictConfig, spec) -> keras.Model:
    """models/<name>.py's build_<name>(spec, **knobs); the knobs are the keys of cfg.model."""
    name = cfg.model.name
    builder = getattr(importlib.import_module(f"models.{name}"), f"build_{name}")
    knobs = {k: v for k, v in cfg.model.items() if k != "name"}
    return builder(spec, **knobs)


def _batchnorm_note(cfg: DictConfig) -> str | None:
    if cfg.accum > 1 and cfg.model.name in IMAGE_MODELS:
        return (
            f"model={cfg.model.name} has BatchNorm, whose statistics update on every "
            f"micro-batch of {cfg.data.batch_size}: accum={cfg.accum} matches a batch of "
            f"{cfg.data.batch_size * cfg.accum} in its gradients, not in its BatchNorm "
            "statistics."
        )
    return None


# How the summary names mem/peak_reserved_bytes, by mem/reserved_source.
_RESERVED_LABEL = {"rss_delta": "process RSS +", "nvidia_smi": "GPU held ", "none": "held ?"}


def _summary(cfg, dev, history, figures, sources, seconds, tracker, notes, table) -> str:
    """The end-of-run summary: printed, and the run's description in the MLflow UI."""
    losses, final = history.losses, history.evals[-1][1]
    lines = [
        f"tfmemlab: model={cfg.model.name} precision={cfg.precision.name} accum={cfg.accum} "
        f"on {dev}: {len(losses)} steps in {seconds:.1f} s",
        f"  train/loss {losses[0]:.4f} -> {losses[-1]:.4f}   val/loss {final['val/loss']:.4f}"
        f"   val/accuracy {final['val/accuracy']:.4f}",
    ]
    if "prune/sparsity" in figures:
        lines.append(report.pruning_summary(figures))
    lines.append(
        f"  peak {figures['mem/peak_bytes'] / 2**20:.1f} MiB (estimate "
        f"{figures['mem/estimate_bytes'] / 2**20:.1f} MiB; "
        f"{_RESERVED_LABEL[sources['mem/reserved_source']]}"
        f"{figures['mem/peak_reserved_bytes'] / 2**20:.1f} MiB)   step "
        f"{figures['speed/step_time_s_p50'] * 1e3:.1f} ms p50   "
        f"{figures['speed/samples_per_s']:.1f} samples/s   compile "
        f"{figures['speed/compile_s']:.1f} s"
    )
    if table:
        lines += profile.summary_lines(figures, table)
    lines += [f"  note: {note}" for note in notes]
    command, url = ui_hint(cfg.mlflow.tracking_uri, tracker.experiment_id, tracker.run_id)
    lines.append(f"  MLflow: run '{tracker.run_name}' in experiment '{cfg.mlflow.experiment}'")
    if command:
        lines.append(f"  open the UI: {command}")
    lines.append(f"  then: {url}")
    return "\n".join(lines)


def _log_setup(tracker, cfg: DictConfig, overrides: list[str]) -> tuple[str, str, bool]:
    """Config and versions first, then the device: a failure there is recorded in the run.
    Returns the device, its human name and whether XLA compiles the steps."""
    log_config(tracker, cfg, overrides)
    tracker.set_tags({"tensorflow": tf.__version__, "keras": keras.__version__})
    gpus = device.setup()
    dev = device.resolve(cfg.trainer.device, gpus)
    name = device.describe(dev, gpus)
    jit = resolve_jit(cfg.trainer.jit_compile, cfg.model.name, dev.startswith("/GPU"))
    tracker.set_tags({"device": dev, "device_name": name, "xla": jit})
    return dev, name, jit


def _train(cfg: DictConfig, model, optimizer, data, total_steps, tracker, mem, jit, pruner):
    """The compiled steps around the readable loop; evaluation and the loss scale as hooks,
    pruning's masks chosen and applied inside the step, right after each update."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    eval_step = make_eval_step(model, loss_fn, jit)
    after_update = pruner.after_update if pruner else None
    return train(
        make_train_step(model, optimizer, loss_fn, cfg.accum, jit, after_update),
        lambda: evaluate(eval_step, data, cfg.trainer.eval_batches),
        data,
        total_steps,
        tracker,
        cfg.trainer.eval_every,
        cfg.trainer.progress,
        mem,
        precision.step_metrics(optimizer),
    )


def _profile(cfg, built, model, optimizer, data, name, pruner, tracker, run_dir, sources):
    """profile.layers=true: the per-layer profile, after the run's own figures are taken;
    its figures are returned, its tags and artifacts logged here."""
    if cfg.profile.layers:
        print("tfmemlab: profiling layer by layer, without XLA (profile.layers=true)", flush=True)
        figures, tags, table, paths = profile.profile_layers(
            cfg, built, model, optimizer, data, name, pruner, run_dir, tracker.run_name
        )
        sources.update(tags)
        for path in paths:
            tracker.log_artifact(path)
        return figures, table
    return {}, []


def _job(cfg: DictConfig, tracker, dev: str, name: str, jit: bool):
    """Data, model, techniques, optimizer, the loop and the report, on `dev`."""
    mem = Memory(dev)
    mem.grow_pool()  # before the job allocates: peaks are then the tensors' need, not rounding
    data = build_data(cfg, image_model=cfg.model.name in IMAGE_MODELS)
    built = build_model(cfg, data.spec)
    total_steps = cfg.trainer.max_steps or cfg.trainer.epochs * data.steps_per_epoch
    model, remat = checkpointing.apply(built, cfg.checkpointing.policy, cfg.checkpointing.every)
    if futile := checkpointing.saves_nothing(remat):
        print(f"tfmemlab: warning: {futile}", flush=True)
        tracker.set_tags({"remat/warning": futile})
    optimizer = precision.wrap_optimizer(build_optimizer(cfg, total_steps), cfg)
    optimizer.build(model.trainable_variables)
    # Shares built's variables; steps on the optimizer's clock, as the LR schedule does.
    pruner = pruning.build_pruner(built, cfg, total_steps, optimizer)
    build_peak = mem.peak()
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    tracker.log_params(
        {
            "effective_batch_size": cfg.data.batch_size * cfg.accum * replicas,
            "replicas": replicas,
            "params_total": model.count_params(),
            "total_steps": total_steps,
            "remat/policy": remat.policy,
        }
    )
    history = _train(cfg, model, optimizer, data, total_steps, tracker, mem, jit, pruner)
    facts = report.RunFacts(built, optimizer, data.spec, history, build_peak, name, jit, remat, mem)
    figures, sources = report.collect(cfg, facts)
    run_dir = _run_dir(tracker.run_id)
    figures.update(report.pruning_figures(pruner, tracker, run_dir, history))
    layer_figures, table = _profile(
        cfg, built, model, optimizer, data, name, pruner, tracker, run_dir, sources
    )
    figures.update(layer_figures)
    report.publish(tracker, figures, history, run_dir, tracker.run_name, sources)
    return figures, sources, history, table


def run(cfg: DictConfig) -> dict:
    validate(cfg)
    overrides = _overrides()
    run_name = cfg.mlflow.run_name or " ".join(overrides) or "default"
    keras.backend.clear_session()
    keras.utils.set_random_seed(cfg.trainer.seed)
    started = time.perf_counter()
    # The run is opened before anything that can fail (device setup included), so every
    # failure after the command-line check leaves a FAILED run with its error (issue 13).
    with mlflow_run(cfg, run_name, _run_dir) as tracker:
        dev, name, jit = _log_setup(tracker, cfg, overrides)
        notes = [n for n in (_batchnorm_note(cfg), precision.note(cfg, dev)) if n]
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        with precision.policy(cfg), tf.device(dev):
            figures, sources, history, table = _job(cfg, tracker, dev, name, jit)
        seconds = time.perf_counter() - started
        summary = _summary(cfg, dev, history, figures, sources, seconds, tracker, notes, table)
        tracker.set_tags({"mlflow.note.content": summary})
    print(summary)
    if tracker.lost is not None:
        run_dir = _run_dir(tracker.run_id)
        print(
            f"tfmemlab: the MLflow server stopped answering during this run ({tracker.lost}). "
            f"Its figures are in {run_dir / 'metrics.json'}, and what MLflow did not get in "
            f"{tracker.pending_path}; once the server is back, send them with:\n"
            f"  python -m runner.track.upload {run_dir}",
            flush=True,
        )
    return {
        "run_id": tracker.run_id,
        "run_name": run_name,
        "steps": len(history.losses),
        **history.evals[-1][1],
        **figures,
        **(
            {"layers/table": table, "layers/top_activation": sources["layers/top_activation"]}
            if table
            else {}
        ),
    }
