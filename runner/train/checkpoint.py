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
  (runner/track/rundir.py finds it). A checkpoint damaged since it was written (a truncated
  copy, a disk fault) is skipped for the one before it, said in one line, and moved to
  `checkpoints/damaged/` (issue 27): the manager's index then names only checkpoints that
  read back whole, so the steps run again are saved again under their own numbers.
"""

import os
import sys
from pathlib import Path

import tensorflow as tf

from runner.core.errors import ResumeError
from runner.track.rundir import CHECKPOINTS, record_sizes
from runner.train.signals import StopOnSignal

DAMAGED = "damaged"  # under checkpoints/: what did not read back, kept for a look


def _damage(path: str) -> str | None:
    """Why the checkpoint `path` does not read back whole, or None. Every tensor is read, which
    checks each one's size and checksum (a truncated data file: "IndexError: Read less bytes
    than requested"); no model is needed, so this runs before the MLflow run is reopened."""
    try:
        reader = tf.train.load_checkpoint(path)
        for name, dtype in reader.get_variable_to_dtype_map().items():
            if dtype != tf.variant:  # the iterator's state: not readable into numpy
                reader.get_tensor(name)
    except Exception as err:
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
    return None


def keep_restorable(run_dir: Path) -> str:
    """Before a resume: the newest checkpoint of `run_dir` that reads back whole. Newer ones
    that do not are said (one line each), moved to checkpoints/damaged/ and dropped from the
    index; none readable is a ResumeError (before the run is reopened: it stays as it was)."""
    folder = run_dir / CHECKPOINTS
    state = tf.train.get_checkpoint_state(str(folder))
    paths = list(state.all_model_checkpoint_paths) if state is not None else []
    times = list(state.all_model_checkpoint_timestamps) if state is not None else []
    damaged = []
    while paths:
        why = _damage(paths[-1])
        if why is None:
            break
        damaged.append((Path(paths.pop()).name, why))
        times = times[: len(paths)]
    for name, why in damaged:
        then = f"going on from {Path(paths[-1]).name}" if paths else "none older reads back"
        print(f"tfmemlab: checkpoint {name} in {folder} does not restore ({why}); {then}",
              file=sys.stderr, flush=True)  # fmt: skip
        (folder / DAMAGED).mkdir(exist_ok=True)
        for file in folder.glob(f"{name}.*"):
            os.replace(file, folder / DAMAGED / file.name)
    if not paths:
        raise ResumeError(
            f"no checkpoint in {folder} restores"
            + (f" (the damaged ones are in {folder / DAMAGED})" if damaged else "")
            + "; the run cannot go on: start the job again"
        )
    if damaged:  # relative names: the run directory can still be moved or copied
        tf.compat.v1.train.update_checkpoint_state(
            str(folder), Path(paths[-1]).name, [Path(p).name for p in paths],
            all_model_checkpoint_timestamps=times or None,
            last_preserved_timestamp=state.last_preserved_timestamp,
        )  # fmt: skip
    return paths[-1]


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
        self.rebind(model, optimizer, pruner)

    def rebind(self, model, optimizer, pruner) -> None:
        """What a checkpoint holds, from these objects on (a model rebuilt smaller by
        pruning=structured: runner/train/removal.py)."""
        state = {
            # Lists of variables, in the order the job builds them: the model's include the
            # dropout seed generators' states and BatchNorm statistics, the optimizer's its
            # step counter, slots and loss scale.
            "model": list(model.variables),
            "optimizer": list(optimizer.variables),
            "iterator": self.iterator,
            "steps_done": self.steps_done,
        }
        if pruner is not None:
            state["masks"] = [*pruner.masks, *getattr(pruner, "taylor", [])]
        self.checkpoint = tf.train.Checkpoint(**state)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, str(self.run_dir / CHECKPOINTS), max_to_keep=2
        )

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int) -> str:
        latest = self.manager.latest_checkpoint
        if latest is not None and latest.endswith(f"ckpt-{step}"):
            return latest  # a signal's save after the step's own
        self.steps_done.assign(step)
        path = self.manager.save(checkpoint_number=step)
        record_sizes(self.run_dir, [Path(p).name for p in self.manager.checkpoints])
        return path

    def restore(self) -> int:
        path = self.manager.latest_checkpoint
        if path is None:
            raise ResumeError(f"no checkpoint in {self.manager.directory}")
        self.checkpoint.restore(path).assert_existing_objects_matched()
        return int(self.steps_done.numpy())
