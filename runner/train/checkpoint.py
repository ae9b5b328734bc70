"""Checkpoints (issue 16): a job killed, preempted or stopped loses nothing.

- Every `trainer.checkpoint_every` optimizer steps and after the last (0: off), and on
  SIGTERM/SIGINT, a `tf.train.Checkpoint` goes into `<run dir>/checkpoints` through a
  `CheckpointManager`, which names a checkpoint in its index only once its files are
  written: a half-written one is never picked up. It holds every variable of the model
  (weights, BatchNorm statistics and the dropout seed generators' states), every variable of
  the optimizer (its step counter, slots and a float16 loss scale), the pruning masks, the
  data iterator (its position, its shuffle state and the batches it had prefetched) and the
  count of optimizer steps done.
- `trainer.resume=<run dir>|latest` restores the last checkpoint into the job as built
  (runner/train/rundir.py finds it).
"""

from pathlib import Path

import tensorflow as tf

from runner.core.errors import ResumeError
from runner.train.rundir import CHECKPOINTS
from runner.train.signals import StopOnSignal


class TrainState:
    """The checkpointed state of a job (see the module docstring); `save(step)` after optimizer
    step `step`, `restore()` -> the steps done."""

    def __init__(self, run_dir: Path, model, optimizer, iterator, pruner, every: int, stop=None):
        self.every, self.run_dir, self.iterator = every, run_dir, iterator
        self.stop: StopOnSignal | None = (
            stop  # installed for the whole job by runner.train.pipeline
        )
        # A multi-worker job's workers agree on the step to stop at on a signal
        # (runner.techniques.distribution.WorkersStop); None: this process stops on its own.
        self.workers = None
        self.steps_done = tf.Variable(0, dtype=tf.int64, trainable=False, name="steps_done")
        state = {
            # Lists of variables, in the order the job builds them: the model's include the
            # dropout seed generators' states and BatchNorm statistics, the optimizer's its
            # step counter, slots and loss scale.
            "model": list(model.variables),
            "optimizer": list(optimizer.variables),
            "iterator": iterator,
            "steps_done": self.steps_done,
        }
        if pruner is not None:
            state["masks"] = list(pruner.masks)
        self.checkpoint = tf.train.Checkpoint(**state)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, str(run_dir / CHECKPOINTS), max_to_keep=2
        )

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int) -> str:
        latest = self.manager.latest_checkpoint
        if latest is not None and latest.endswith(f"ckpt-{step}"):
            return latest  # a signal's save after the step's own
        self.steps_done.assign(step)
        return self.manager.save(checkpoint_number=step)

    def restore(self) -> int:
        path = self.manager.latest_checkpoint
        if path is None:
            raise ResumeError(f"no checkpoint in {self.manager.directory}")
        self.checkpoint.restore(path).assert_existing_objects_matched()
        return int(self.steps_done.numpy())
