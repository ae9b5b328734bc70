"""`run(cfg) -> dict`: the whole pipeline, top to bottom.

seed -> precision -> data -> model -> techniques (checkpointing, pruning) -> optimizer ->
train loop -> evaluate -> report -> keep (the datasets with their digests, the trained model:
runner/track/datasets.py, runner/track/model.py; the code's commit is tagged at setup,
runner/track/commit.py) -> deploy (deploy=litert: the kept model measured where it runs,
runner/deploy/). accum=auto is decided before this (runner/plan/auto.py,
which run.py calls), and a sweep's job is handed the tags that place it under its sweep.
"""

import contextlib
import sys
import time
from pathlib import Path

import keras
import tensorflow as tf
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from models.common import is_graph
from runner.config import name_model, takes_images, validate
from runner.core.errors import ConfigError
from runner.core.secrets import redact
from runner.core.start import quiet_python_logs
from runner.feed.pipelines import build_data, source_errors
from runner.measure import profile
from runner.measure.history import History
from runner.measure.telemetry import Memory, replica_memory
from runner.report import figures as report
from runner.report import layer_report
from runner.report import pruning as pruning_report
from runner.report.structured import structured_figures
from runner.report.summary import Outcome, summary
from runner.techniques import distribution, precision
from runner.techniques.structured import ChannelPruner
from runner.track import rundir
from runner.track.commit import source_tags
from runner.track.datasets import Tap, log_datasets
from runner.track.lifecycle import log_config, mlflow_run, say_if_lost
from runner.track.model import input_example, keep_model
from runner.track.tracker import WorkerTracker
from runner.train import batchnorm, device
from runner.train.checkpoint import keep_restorable
from runner.train.compiled import Compiled
from runner.train.faults import training_fault
from runner.train.job import Built, Job, build, train_state
from runner.train.loop import Steps, evaluate, train
from runner.train.optimizer import resolve_jit
from runner.train.removal import Removal, marker, resume_removed
from runner.train.signals import StopOnSignal


def _setup(cfg, tracker, run_dir: Path, stop, point, overrides: list[str]) -> Job:
    """Config and versions first, then the device: a failure there is recorded in the run. A
    resumed run (a resume point) has its config logged already."""
    if point is None:
        log_config(tracker, cfg, overrides)
    tracker.set_tags({"tensorflow": tf.__version__, "keras": keras.__version__, **source_tags()})
    gpus = device.setup()
    strategy = distribution.make_strategy(cfg.distribution, gpus)  # before any op runs
    dev = device.resolve(cfg.trainer.device, gpus)
    name = device.describe(dev, gpus)
    jit = resolve_jit(cfg.trainer.jit_compile, cfg.model.name, dev.startswith("/GPU"))
    tracker.set_tags({"device": dev, "device_name": name, "xla": jit})
    if strategy is not None:
        devices = distribution.local_devices(strategy, dev)
        tracker.set_tags({"distribution": cfg.distribution.strategy, "replica_devices": devices})
    return Job(cfg, tracker, run_dir, stop, dev, name, jit, strategy, point is not None)


def _train(job: Job, built: Built, state, first: int, mem: Memory, tap: Tap) -> History:
    """The compiled steps around the readable loop from optimizer step `first`; evaluation and
    the loss scale as hooks, pruning's masks chosen and applied inside the step, right after
    each update (structured pruning's chosen between steps, and its removal: removal.py).
    Under a strategy each replica takes its part of every micro-batch, and every worker
    evaluates the whole validation split."""
    cfg, st = job.cfg, job.strategy
    compiled = Compiled(job, built)
    removal = (
        Removal(job, built, state, compiled) if isinstance(built.pruner, ChannelPruner) else None
    )
    steps = Steps(
        train_step=compiled.train,
        evaluate=lambda: _evaluate(cfg, built, compiled.eval_step),
        batches=distribution.feed(st, tap, cfg.data.batch_size) if st else tap,
        total=built.total_steps,
        first=first,
        eval_every=cfg.trainer.eval_every,
        progress=cfg.trainer.progress,
        step_metrics=compiled.step_metrics,
        after_step=removal.after_step if removal else None,
    )
    return train(steps, job.tracker, mem, state)


def _evaluate(cfg, built: Built, eval_step) -> dict:
    """The validation figures; with trainer.bn_recalibrate=N, BatchNorm statistics first
    re-estimated on N training micro-batches (runner/train/batchnorm.py)."""
    if cfg.trainer.bn_recalibrate:
        batches = iter(built.data.twin())  # a copy's batches: training's order is left as is
        batchnorm.recalibrate(built.model, batches, cfg.trainer.bn_recalibrate)
    return evaluate(eval_step, built.data, cfg.trainer.eval_batches)


def _profile(job: Job, built: Built, sources: dict) -> tuple[dict, list]:
    """profile.layers=true: the per-layer profile, after the run's own figures are taken;
    its figures are returned, its tags and artifacts logged here."""
    if not job.cfg.profile.layers:
        return {}, []
    if not is_graph(built.model):  # a subclassed model: its layers are not rows to time
        why = "not profiled: a subclassed model's layers cannot be read as a graph"
        print(f"tfmemlab: profile.layers: {why}", flush=True)
        sources["layers/skipped"] = why
        return {}, []
    print("tfmemlab: profiling layer by layer, without XLA (profile.layers=true)", flush=True)
    figures, tags, table, roof = profile.profile_layers(
        job.cfg, built.model, built.trained, built.optimizer, built.data, built.pruner,
        job.device_name,
    )  # fmt: skip
    sources.update(tags)
    for path in layer_report.write(table, roof, job.run_dir, job.tracker.run_name):
        job.tracker.log_artifact(path)
    return figures, table


def _job(job: Job, notes: list[str]) -> tuple[dict, dict, History, list]:
    """Data, model, techniques, optimizer, the loop and the report, on the job's device (or
    the replicas of its strategy); from the run directory's last checkpoint when resuming.
    BatchNorm's notes are added to `notes` (printed now, and in the summary)."""
    cfg, st, tracker = job.cfg, job.strategy, job.tracker
    mem = replica_memory(distribution.local_devices(st, job.device)) if st else Memory(job.device)
    mem.grow_pool()  # before the job allocates: peaks are then the tensors' need, not rounding
    # measure: the process's RSS growth over the data's setup (its first batch drawn), so a
    # source held in memory is told from a streamed one (host/data_setup_rss_bytes)
    data = build_data(cfg, takes_images(cfg), job.replicas, measure=True)
    built = build(job, data)
    _note(notes, batchnorm.accum_note(cfg, built.model))
    params_total = built.trained.count_params()  # as built (a resume may rebuild it smaller)
    if job.resuming and isinstance(built.pruner, ChannelPruner):
        resume_removed(job, built)  # a checkpoint of the smaller model: its structure first
    state = train_state(job, built)
    tap = Tap(state.iterator)  # the training split's digest, from the batches it trains on
    first = 1
    if job.resuming:
        first = state.restore() + 1
        print(f"tfmemlab: resumed after optimizer step {first - 1} from {job.run_dir}", flush=True)
        tracker.set_tags({"resumed_from_step": first - 1})
        # The figures below cover the resumed steps only (this process's allocator and clock).
        tracker.set_tags({"figures_cover_steps": f"{first}-{built.total_steps}"})
    build_peak = mem.peak()
    tracker.log_params(  # a resumed run logs the same values again, which MLflow accepts
        {
            "effective_batch_size": cfg.data.batch_size * cfg.accum * job.replicas,
            "replicas": job.replicas,
            "params_total": params_total,
            "total_steps": built.total_steps,
            "remat/policy": built.remat.policy,
        }
    )
    try:
        history = _train(job, built, state, first, mem, tap)
    except Exception as err:  # a full disk (checked first), out of memory: in one line
        fault = training_fault(err, job, built, state)
        if fault is err:
            raise
        raise fault from None
    updates = built.total_steps * cfg.accum  # micro-batches: BatchNorm updates once for each
    _note(notes, batchnorm.short_run_note(cfg, built.model, updates))
    structured = isinstance(built.pruner, ChannelPruner)
    marked = marker(job) if structured else None
    # After a removal the run's figures are the smaller model's steps (the earlier ones: prune/)
    measured = history.after(marked["step"]) if marked else history
    facts = report.RunFacts(
        built.model, built.optimizer, data.spec, measured, build_peak, job.device_name, job.jit,
        built.remat, mem, job.replicas, built.trained,
    )  # fmt: skip
    figures, sources = report.collect(cfg, facts)
    figures["host/data_setup_rss_bytes"] = data.setup_rss_bytes
    # A collective: every worker takes part, and the chief logs every replica's figures.
    chief = not isinstance(tracker, WorkerTracker)
    replica_figures, replica_tags = distribution.replica_figures(st, history, figures, chief)
    figures.update(replica_figures)
    sources.update(replica_tags)
    if structured:
        figures.update(structured_figures(built.pruner, tracker, history, marked, data.spec))
    else:
        figures.update(pruning_report.pruning_figures(built.pruner, tracker, job.run_dir, history))
    layer_figures, table = _profile(job, built, sources)
    figures.update(layer_figures)
    report.publish(tracker, figures, history, job.run_dir, tracker.run_name, sources)
    if not job.resuming:  # a resumed run's first batches are not the split's
        log_datasets(tracker, cfg.data, {"train": data.train, "val": data.val}, tap.digests)
    if cfg.trainer.get("save_model", True):  # after the last step; not on failure or signal
        example = input_example(data.val)
        keep_model(tracker, built.model, job.run_dir, example, built.total_steps)
        figures.update(_deploy(job, data))
    return figures, sources, history, table


def _deploy(job: Job, data) -> dict:
    """deploy=litert: the kept model measured where it runs (runner/deploy/). deploy=none
    imports nothing of it: the default run does not pay for the converter or LiteRT."""
    if OmegaConf.select(job.cfg, "deploy.name", default="none") == "none":  # or an older run's
        return {}
    from runner.deploy.job import measure_kept

    return measure_kept(job.cfg, job.tracker, job.run_dir, data)


def _note(notes: list[str], note: str | None) -> None:
    if note:
        print(f"note: {note}", file=sys.stderr)
        notes.append(note)


def _resumed_config(point: rundir.ResumePoint, cfg: DictConfig) -> DictConfig:
    """The config the resumed run was started with (its job is rebuilt exactly), with this
    command's trainer.resume."""
    saved = point.config.copy()
    saved.trainer.resume = cfg.trainer.resume
    return saved


def _tracker(cfg, run_name: str, point, overrides: list[str], tags: dict | None):
    """The run in MLflow (reopened when resuming); a non-chief worker of a multi-worker job
    logs nothing (its figures reach the chief's run through the strategy)."""
    if not distribution.is_chief(cfg.distribution):
        return contextlib.nullcontext(WorkerTracker(run_name))

    def run_dir_of(run_id: str) -> Path:
        return point.run_dir if point is not None else rundir.hydra_run_dir(run_id)

    resumed_id = point.run_id if point is not None else None
    job = rundir.job_key(overrides) if point is None else point.job
    return mlflow_run(cfg, run_name, run_dir_of, resumed_id, job, tags)


def run(cfg: DictConfig, tags: dict | None = None, plan: dict | None = None) -> dict:
    """Train the job `cfg` describes, record it in MLflow, and return its figures.

    tags: set on the new MLflow run (a sweep's job: runner.sweep.state.sweep_tags); plan:
    accum=auto's record (runner/plan/auto.py), logged with the run."""
    quiet_python_logs()
    validate(name_model(cfg))
    overrides = rundir.hydra_overrides()
    point = rundir.locate(cfg.trainer.resume, overrides) if cfg.trainer.resume else None
    if point is not None:
        keep_restorable(point.run_dir)  # damaged checkpoints set aside, before the run reopens
        cfg = _resumed_config(point, cfg)
    if cfg.accum == "auto":
        raise ConfigError("accum", "auto", "an integer here: runner.plan.auto decides it first")
    run_name = redact(cfg.mlflow.run_name) if cfg.mlflow.run_name else rundir.run_name(overrides)
    if cfg.trainer.deterministic:  # process-wide: the ops that follow are deterministic
        tf.config.experimental.enable_op_determinism()
    keras.backend.clear_session()
    keras.utils.set_random_seed(cfg.trainer.seed)
    started = time.perf_counter()
    # The run is opened before anything that can fail (device setup included), so every
    # failure after the command-line check leaves a FAILED run with its error (issue 13).
    # SIGTERM/SIGINT from here on end the job after its next optimizer step, checkpointed.
    # One process at a time in a run directory, held before MLflow is told anything (issue 27).
    hydra_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
    lock = rundir.run_lock(point, cfg.trainer.resume, hydra_dir)
    with lock, StopOnSignal() as stop, _tracker(cfg, run_name, point, overrides, tags) as tracker:
        run_dir = point.run_dir if point is not None else rundir.hydra_run_dir(tracker.run_id)
        if point is None:
            rundir.write_run_file(run_dir, tracker.run_id, cfg, overrides)
        if plan is not None:
            report.log_plan(tracker, plan, run_dir)
        job = _setup(cfg, tracker, run_dir, stop, point, overrides)
        stop.take_back()  # from TensorFlow's coordination service (multi_worker)
        notes: list[str] = []
        _note(notes, precision.note(cfg.precision, job.device))
        # Under a strategy its scope places the variables and strategy.run the steps.
        where = tf.device(job.device) if job.strategy is None else contextlib.nullcontext()
        with precision.policy(cfg.precision), where, source_errors(cfg):
            figures, sources, history, table = _job(job, notes)
        seconds = time.perf_counter() - started
        shown = job.device
        if job.strategy is not None:
            shown = f"{job.replicas} replicas ({cfg.distribution.strategy})"
        outcome = Outcome(shown, history, figures, sources, seconds, notes, table)
        text = summary(cfg, tracker, outcome)
        tracker.set_tags({"mlflow.note.content": text})
    print(text)
    say_if_lost(tracker, run_dir)
    return _result(tracker, history, figures, sources, table)


def _result(tracker, history: History, figures: dict, sources: dict, table: list) -> dict:
    layers = {"layers/table": table, "layers/top_activation": sources.get("layers/top_activation")}
    run = {"run_id": tracker.run_id, "run_name": tracker.run_name, "steps": len(history.losses)}
    return {**run, **history.evals[-1][1], **figures, **(layers if table else {})}
