"""`run(cfg) -> dict`: the whole pipeline, top to bottom.

seed -> precision -> data -> model -> techniques (checkpointing, pruning) -> optimizer ->
train loop -> evaluate -> report.
"""

import contextlib
import importlib
import os
import sys
import time
from pathlib import Path

import keras
import tensorflow as tf
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner import device, plan, resume
from runner.config import IMAGE_MODELS, validate
from runner.data import build_data
from runner.loop import evaluate, train
from runner.measure import estimate, profile, report
from runner.measure.telemetry import Memory, replica_memory
from runner.step import build_optimizer, make_eval_step, make_train_step, resolve_jit
from runner.techniques import checkpointing, distribution, precision, pruning
from runner.track.tracking import WorkerTracker, log_config, mlflow_run


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


def _log_setup(tracker, cfg: DictConfig, overrides: list[str] | None):
    """Config and versions first, then the device: a failure there is recorded in the run.
    Returns the device, its human name, whether XLA compiles the steps and the tf.distribute
    strategy (None: one device). A resumed run (overrides None) has its config logged."""
    if overrides is not None:
        log_config(tracker, cfg, overrides)
    tracker.set_tags({"tensorflow": tf.__version__, "keras": keras.__version__})
    gpus = device.setup()
    strategy = distribution.make_strategy(cfg, gpus)  # before any op runs (logical CPUs)
    dev = device.resolve(cfg.trainer.device, gpus)
    name = device.describe(dev, gpus)
    jit = resolve_jit(cfg.trainer.jit_compile, cfg.model.name, dev.startswith("/GPU"))
    tracker.set_tags({"device": dev, "device_name": name, "xla": jit})
    if strategy is not None:
        devices = distribution.local_devices(strategy, dev)
        tracker.set_tags({"distribution": cfg.distribution.strategy, "replica_devices": devices})
    return dev, name, jit, strategy


def _train(cfg, model, optimizer, data, total_steps, tracker, mem, jit, pruner, state, first, st):
    """The compiled steps around the readable loop from optimizer step `first`; evaluation and
    the loss scale as hooks, pruning's masks chosen and applied inside the step, right after
    each update; `state` checkpointed as the loop says (runner/resume.py). Under the
    tf.distribute strategy `st` each replica takes its part of every micro-batch, and every
    worker evaluates the whole validation split."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    eval_step = make_eval_step(model, loss_fn, jit)
    after_update = pruner.after_update if pruner else None
    feed = distribution.feed(st, state.iterator, cfg.data.batch_size) if st else state.iterator
    return train(
        make_train_step(model, optimizer, loss_fn, cfg.accum, jit, after_update, st),
        lambda: evaluate(eval_step, data, cfg.trainer.eval_batches),
        feed,
        total_steps,
        tracker,
        cfg.trainer.eval_every,
        cfg.trainer.progress,
        mem,
        precision.step_metrics(optimizer),
        state,
        first,
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


def _out_of_memory(err, cfg, built, optimizer, spec, jit, name, remat):
    """The same error, its message saying what ran out and which levers to try."""
    cpu_xla = report.is_cpu_xla(jit, name)
    total = estimate.estimate_memory(built, optimizer, cfg, spec, cpu_xla, remat)["total"]
    limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB") if "GPU" not in name.upper() else None
    b, k = cfg.data.batch_size, cfg.accum
    halved = f"accum={2 * k} data.batch_size={b // 2} (the same effective batch), " if b > 1 else ""
    message = (
        f"out of memory at optimizer step {getattr(err, 'tfmemlab_step', '?')} with micro-batch "
        f"data.batch_size={b} x accum={k}: the estimate for this job is {total / 2**20:.1f} MiB "
        + (f"against a limit of {limit} MiB " if limit else f"on {name} ")
        + f"(checkpointing={cfg.checkpointing.policy}, precision={cfg.precision.name}); to "
        f"fit, try {halved}checkpointing=blocks or selective, precision=mixed or bf16, or a "
        f"smaller data.batch_size. TensorFlow: {str(err.message).splitlines()[0][:300]}"
    )
    return tf.errors.ResourceExhaustedError(err.node_def, err.op, message)


def _build(cfg, tracker, data, total_steps):
    """The model, its checkpointing, the optimizer and the pruner (under the strategy's scope,
    when there is one: their variables are then mirrored on every replica)."""
    built = build_model(cfg, data.spec)
    model, remat = checkpointing.apply(built, cfg.checkpointing.policy, cfg.checkpointing.every)
    if futile := checkpointing.saves_nothing(remat):
        print(f"tfmemlab: warning: {futile}", flush=True)
        tracker.set_tags({"remat/warning": futile})
    optimizer = precision.wrap_optimizer(build_optimizer(cfg, total_steps), cfg)
    optimizer.build(model.trainable_variables)
    # Shares built's variables; steps on the optimizer's clock, as the LR schedule does.
    pruner = pruning.build_pruner(built, cfg, total_steps, optimizer)
    return built, model, remat, optimizer, pruner


def _state(cfg, st, run_dir, built, optimizer, pruner, data, stop, tracker) -> resume.TrainState:
    """What a checkpoint holds (runner/resume.py), the data iterator this worker reads among
    them; in a multi-worker job, the workers' agreement on when to stop on a signal."""
    b = cfg.data.batch_size
    batches = distribution.worker_batches(st, data.train, b) if st else data.train
    state = resume.TrainState(
        run_dir, built, optimizer, iter(batches), pruner, cfg.trainer.checkpoint_every, stop
    )
    if cfg.distribution.strategy == "multi_worker":
        state.workers = distribution.WorkersStop(
            st,
            run_dir,
            stop,
            lambda step: (tracker.flush(), state.save(step)),
            lambda signum, step: resume.Interrupted(signum, step, run_dir),
        )
    return state


def _job(cfg, tracker, dev: str, name: str, jit: bool, run_dir: Path, resuming: bool, stop, st):
    """Data, model, techniques, optimizer, the loop and the report, on `dev` (or the replicas
    of the tf.distribute strategy `st`); from the run directory's last checkpoint when
    `resuming`."""
    mem = replica_memory(distribution.local_devices(st, dev)) if st else Memory(dev)
    mem.grow_pool()  # before the job allocates: peaks are then the tensors' need, not rounding
    replicas = distribution.replicas(st)
    data = build_data(cfg, cfg.model.name in IMAGE_MODELS, replicas)
    total_steps = cfg.trainer.max_steps or cfg.trainer.epochs * data.steps_per_epoch
    with st.scope() if st else contextlib.nullcontext():
        built, model, remat, optimizer, pruner = _build(cfg, tracker, data, total_steps)
    state = _state(cfg, st, run_dir, built, optimizer, pruner, data, stop, tracker)
    first = 1
    if resuming:
        first = state.restore() + 1
        print(f"tfmemlab: resumed after optimizer step {first - 1} from {run_dir}", flush=True)
        tracker.set_tags({"resumed_from_step": first - 1})
        # The figures below cover the resumed steps only (this process's allocator and clock).
        tracker.set_tags({"figures_cover_steps": f"{first}-{total_steps}"})
    build_peak = mem.peak()
    tracker.log_params(  # a resumed run logs the same values again, which MLflow accepts
        {
            "effective_batch_size": cfg.data.batch_size * cfg.accum * replicas,
            "replicas": replicas,
            "params_total": model.count_params(),
            "total_steps": total_steps,
            "remat/policy": remat.policy,
        }
    )
    try:
        history = _train(
            cfg, model, optimizer, data, total_steps, tracker, mem, jit, pruner, state, first, st
        )
    except tf.errors.ResourceExhaustedError as err:
        raise _out_of_memory(err, cfg, built, optimizer, data.spec, jit, name, remat) from None
    facts = report.RunFacts(
        built, optimizer, data.spec, history, build_peak, name, jit, remat, mem, replicas
    )
    figures, sources = report.collect(cfg, facts)
    # A collective: every worker takes part, and the chief logs every replica's figures.
    chief = not isinstance(tracker, WorkerTracker)
    replica_figures, replica_tags = distribution.replica_figures(st, history, figures, chief)
    figures.update(replica_figures)
    sources.update(replica_tags)
    figures.update(report.pruning_figures(pruner, tracker, run_dir, history))
    layer_figures, table = _profile(
        cfg, built, model, optimizer, data, name, pruner, tracker, run_dir, sources
    )
    figures.update(layer_figures)
    report.publish(tracker, figures, history, run_dir, tracker.run_name, sources)
    return figures, sources, history, table


def _resumed_config(point: resume.ResumePoint, cfg: DictConfig) -> DictConfig:
    """The config the resumed run was started with (its job is rebuilt exactly), with this
    command's trainer.resume."""
    saved = point.config.copy()
    saved.trainer.resume = cfg.trainer.resume
    return saved


def run(cfg: DictConfig) -> dict:
    validate(cfg)
    overrides = _overrides()
    point = resume.locate(cfg.trainer.resume, overrides) if cfg.trainer.resume else None
    if point is not None:
        cfg = _resumed_config(point, cfg)
    plan_record = None
    if cfg.accum == "auto":  # measured by probes in fresh processes, before this run allocates
        cfg, plan_record = plan.auto(cfg)
    run_name = cfg.mlflow.run_name or " ".join(overrides) or "default"
    if cfg.trainer.deterministic:  # process-wide: the ops that follow are deterministic
        tf.config.experimental.enable_op_determinism()
    keras.backend.clear_session()
    keras.utils.set_random_seed(cfg.trainer.seed)
    started = time.perf_counter()

    def run_dir_of(run_id: str) -> Path:
        return point.run_dir if point is not None else _run_dir(run_id)

    # The run is opened before anything that can fail (device setup included), so every
    # failure after the command-line check leaves a FAILED run with its error (issue 13).
    resumed_id = point.run_id if point is not None else None
    job = resume.job_key(overrides) if point is None else point.job
    # SIGTERM/SIGINT from here on end the job after its next optimizer step, checkpointed.
    with (
        resume.StopOnSignal() as stop,
        (
            mlflow_run(cfg, run_name, run_dir_of, resumed_id, job)
            if distribution.is_chief(cfg)
            else contextlib.nullcontext(WorkerTracker(run_name))
        ) as tracker,
    ):
        run_dir = run_dir_of(tracker.run_id)
        if point is None:
            resume.write_run_file(run_dir, tracker.run_id, cfg, overrides)
        if plan_record is not None:
            plan.log_plan(tracker, plan_record, run_dir)
        dev, name, jit, st = _log_setup(tracker, cfg, overrides if point is None else None)
        stop.take_back()  # from TensorFlow's coordination service (multi_worker)
        notes = [n for n in (_batchnorm_note(cfg), precision.note(cfg, dev)) if n]
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        # Under a strategy its scope places the variables and strategy.run the steps.
        with precision.policy(cfg), tf.device(dev) if st is None else contextlib.nullcontext():
            figures, sources, history, table = _job(
                cfg, tracker, dev, name, jit, run_dir, point is not None, stop, st
            )
        seconds = time.perf_counter() - started
        where = (
            dev
            if st is None
            else f"{distribution.replicas(st)} replicas ({cfg.distribution.strategy})"
        )
        summary = report.summary(
            cfg, where, history, figures, sources, seconds, tracker, notes, table
        )
        tracker.set_tags({"mlflow.note.content": summary})
    print(summary)
    if tracker.lost is not None:
        print(
            f"tfmemlab: the MLflow server stopped answering during this run ({tracker.lost}). "
            f"Its figures are in {run_dir / 'metrics.json'}, and what MLflow did not get in "
            f"{tracker.pending_path}; once the server is back, send them with:\n"
            f"  python -m runner.track.upload {run_dir}",
            flush=True,
        )
    return {
        "run_id": tracker.run_id,
        "run_name": tracker.run_name,
        "steps": len(history.losses),
        **history.evals[-1][1],
        **figures,
        **(
            {"layers/table": table, "layers/top_activation": sources["layers/top_activation"]}
            if table
            else {}
        ),
    }
