"""The job a run trains, built: where it runs (Job) and what it trains with (Built).

`Job` holds the run's state that every step of the pipeline needs (config, tracker, run
directory, the signal watch, device, XLA, tf.distribute strategy), so that each step takes
one object instead of a dozen positional parameters; `build` makes the model, checkpointing's
wrapper, the optimizer and the pruner, and `train_state` what a checkpoint holds.
"""

import contextlib
import importlib
from dataclasses import dataclass
from pathlib import Path

import keras
import tensorflow as tf
from omegaconf import DictConfig
from tensorflow.python.framework import ops

from runner.config.model import is_target
from runner.core.errors import Interrupted
from runner.feed.pipelines import Data
from runner.schedules import schedule_of
from runner.techniques import checkpointing, distribution, precision, pruning
from runner.techniques.checkpointing import RematInfo
from runner.techniques.pruning import Pruner
from runner.techniques.structured import ChannelPruner
from runner.track.tracker import Tracker
from runner.train.checkpoint import TrainState
from runner.train.optimizer import build_optimizer
from runner.train.signals import StopOnSignal
from runner.train.usermodel import build_target


@dataclass
class Job:
    """Where and how the run trains (see the module docstring)."""

    cfg: DictConfig
    tracker: Tracker
    run_dir: Path
    stop: StopOnSignal
    device: str  # a TensorFlow device name, e.g. /CPU:0
    device_name: str  # its human name (runner.train.device.describe)
    jit: bool  # XLA compiles the steps
    strategy: tf.distribute.Strategy | None = None  # None: one device
    resuming: bool = False  # from the run directory's last checkpoint

    @property
    def replicas(self) -> int:
        return distribution.replicas(self.strategy)

    def scope(self):
        """The strategy's scope (its variables mirrored on every replica), or none."""
        return self.strategy.scope() if self.strategy else contextlib.nullcontext()


@dataclass
class Built:
    """What the job trains with."""

    model: keras.Model  # as built, before checkpointing wrapped it (the figures' model)
    trained: keras.Model  # what the step calls: checkpointing's wrapper, or model itself
    remat: RematInfo
    optimizer: keras.optimizers.Optimizer
    pruner: Pruner | ChannelPruner | None
    data: Data
    total_steps: int
    # The names in TensorFlow's gradient registry before the model was built: every custom
    # gradient registered from then on is of this job's traces (runner/train/compiled.py).
    gradients_before: frozenset[str]


def gradient_registry() -> dict:
    """TensorFlow's gradient functions by op type name (private: ops._gradient_registry)."""
    return ops._gradient_registry._registry


def build_model(m: DictConfig, spec) -> keras.Model:
    """models/<name>.py's build_<name>(spec, **knobs), the knobs the keys of cfg.model `m`; or,
    when `m` has a `_target_`, what it names, checked against the data (usermodel.py)."""
    if is_target(m):
        return build_target(m, spec)
    builder = getattr(importlib.import_module(f"models.{m.name}"), f"build_{m.name}")
    return builder(spec, **{k: v for k, v in m.items() if k != "name"})


def build(job: Job, data: Data) -> Built:
    """The model, its checkpointing, the optimizer and the pruner (under the strategy's scope,
    when there is one: their variables are then mirrored on every replica)."""
    cfg = job.cfg
    total_steps = cfg.trainer.max_steps or cfg.trainer.epochs * data.steps_per_epoch
    structured = schedule_of(cfg.pruning).removes
    before = frozenset(gradient_registry())
    with job.scope():
        model = build_model(cfg.model, data.spec)
        # Its channel groups are read from the model's own graph, before checkpointing's
        # segments call its layers again (runner/train/removal.py rebuilds them after a removal).
        pruner = ChannelPruner(model, cfg.pruning, total_steps) if structured else None
        trained, remat = checkpointing.apply(
            model, cfg.checkpointing.policy, cfg.checkpointing.every
        )
        if futile := checkpointing.saves_nothing(remat):
            print(f"tfmemlab: warning: {futile}", flush=True)
            job.tracker.set_tags({"remat/warning": futile})
        optimizer = precision.wrap_optimizer(
            build_optimizer(cfg.trainer, total_steps), cfg.precision
        )
        optimizer.build(trained.trainable_variables)
        # Shares the model's variables; steps on the optimizer's clock, as the LR schedule does.
        if not structured:
            pruner = pruning.build_pruner(model, cfg.pruning, total_steps, optimizer)
    return Built(model, trained, remat, optimizer, pruner, data, total_steps, before)


def train_state(job: Job, built: Built) -> TrainState:
    """What a checkpoint holds (runner/train/checkpoint.py), the data iterator this worker reads
    among them; in a multi-worker job, the workers' agreement on when to stop on a signal."""
    b, st = job.cfg.data.batch_size, job.strategy
    batches = distribution.worker_batches(st, built.data.train, b) if st else built.data.train
    state = TrainState(
        job.run_dir,
        built.model,
        built.optimizer,
        iter(batches),
        built.pruner,
        job.cfg.trainer.checkpoint_every,
        job.stop,
    )
    if job.cfg.distribution.strategy == "multi_worker":
        state.workers = distribution.WorkersStop(
            st,
            job.run_dir,
            job.stop,
            lambda step: (job.tracker.flush(), state.save(step)),
            lambda signum, step: Interrupted(signum, step, job.run_dir),
        )
    return state
