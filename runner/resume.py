"""Checkpoints, resume and signals (issue 16): a job killed, preempted or stopped loses nothing.

- Every `trainer.checkpoint_every` optimizer steps and after the last (0: off), and on
  SIGTERM/SIGINT, a `tf.train.Checkpoint` goes into `<run dir>/checkpoints` through a
  `CheckpointManager`, which names a checkpoint in its index only once its files are
  written: a half-written one is never picked up. It holds every variable of the model
  (weights, BatchNorm statistics and the dropout seed generators' states), every variable of
  the optimizer (its step counter, slots and a float16 loss scale), the pruning masks, the
  data iterator (its position, its shuffle state and the batches it had prefetched) and the
  count of optimizer steps done.
- `trainer.resume=<run dir>|latest` restores the last checkpoint into the job as built, and
  goes on in the same MLflow run from the step after it: no step the checkpoint holds is run
  again, and no (metric, step) pair the run already has is logged again.
- SIGTERM or SIGINT lets the current optimizer step finish, writes a checkpoint, marks the
  run KILLED and exits with 128 + the signal's number (143, 130).

`run.json` in the run directory names the MLflow run, the job and its resolved config, so
that `trainer.resume` can find the run and build the same job.
"""

import json
import os
import re
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

RUN_FILE = "run.json"
CHECKPOINTS = "checkpoints"
# Overrides that do not change the job trained.
NOT_THE_JOB = ("trainer.resume", "sweep.resume", "hydra.")


class Interrupted(BaseException):
    """The job was stopped by a signal after a checkpoint (a BaseException, like
    KeyboardInterrupt: it is not the job's error)."""

    def __init__(self, signum: int, step: int, run_dir: Path):
        self.signum, self.step, self.run_dir = signum, step, run_dir
        self.exit_code = 128 + signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after optimizer step {step}; its "
            f"checkpoint is in {run_dir / CHECKPOINTS}"
        )


class StopOnSignal:
    """SIGTERM and SIGINT set `signum` instead of stopping the process, so the loop can end the
    step it is in and checkpoint; a second SIGINT stops at once (KeyboardInterrupt)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def take_back(self) -> None:
        """Handle SIGTERM and SIGINT here again. TensorFlow's coordination service (a
        multi-worker strategy) installs a SIGTERM handler of its own in C++, over Python's:
        measured, a SIGTERM after MultiWorkerMirroredStrategy() left `signum` None."""
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def job_key(overrides: list[str]) -> str:
    """The job a command line describes: its overrides, sorted, less those that do not change
    what is trained (trainer.resume, hydra.*)."""
    kept = sorted(o for o in overrides if not o.lstrip("+~").startswith(NOT_THE_JOB))
    return " ".join(kept) or "default"


@dataclass
class ResumePoint:
    run_dir: Path
    run_id: str
    tracking_uri: str
    job: str
    config: DictConfig  # the resolved config the run was started with


def write_run_file(run_dir: Path, run_id: str, cfg: DictConfig, overrides: list[str]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "run_id": run_id,
        "tracking_uri": cfg.mlflow.tracking_uri,
        "job": job_key(overrides),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    (run_dir / RUN_FILE).write_text(json.dumps(record, indent=2))


def _has_checkpoint(run_dir: Path) -> bool:
    return (run_dir / CHECKPOINTS / "checkpoint").is_file()


def newest_folder(root: Path, name: str, wanted: Callable[[dict, Path], bool]) -> Path | None:
    """The folder under `root` whose JSON file `name` is newest among those `wanted(record,
    folder)` accepts; unreadable files are passed over."""
    found = []
    for path in root.glob(f"**/{name}"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if wanted(record, path.parent):
            found.append((path.stat().st_mtime, path.parent))
    return max(found)[1] if found else None


def latest_run_dir(job: str, root: Path = Path("outputs")) -> Path | None:
    """The newest run directory under `root` of the job `job` that holds a checkpoint."""
    return newest_folder(
        root, RUN_FILE, lambda record, folder: record.get("job") == job and _has_checkpoint(folder)
    )


def _checkpointed_step(run_dir: Path) -> int | None:
    """The optimizer step of the run's last checkpoint, from the manager's index
    (`model_checkpoint_path: "ckpt-<step>"`), read without TensorFlow."""
    index = (run_dir / CHECKPOINTS / "checkpoint").read_text()
    match = re.search(r'^model_checkpoint_path: ".*ckpt-(\d+)"', index, re.MULTILINE)
    return int(match.group(1)) if match else None


class ResumeError(ValueError):
    """trainer.resume cannot be honoured; the message is one line."""


def locate(resume: str, overrides: list[str]) -> ResumePoint:
    """The run `trainer.resume=<resume>` continues: a run directory, or `latest` (the newest
    one of this job). Checked before TensorFlow is imported."""
    job = job_key(overrides)
    if resume == "latest":
        run_dir = latest_run_dir(job)
        if run_dir is None:
            raise ResumeError(
                f"trainer.resume=latest: no run directory of the job '{job}' under outputs/ "
                "holds a checkpoint (set trainer.checkpoint_every, or stop a run with SIGTERM)"
            )
    else:
        run_dir = Path(resume)
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise ResumeError(f"trainer.resume={resume}: no {RUN_FILE} there; expected a run directory")
    if not _has_checkpoint(run_dir):
        raise ResumeError(f"trainer.resume={resume}: the run there wrote no checkpoint")
    record = json.loads(path.read_text())
    if job != "default" and job != record["job"]:
        raise ResumeError(
            f"trainer.resume={resume}: that run trained the job '{record['job']}', not '{job}'"
            " (give only trainer.resume=<run dir> to continue it as it was)"
        )
    config = OmegaConf.create(record["config"])
    done, total = _checkpointed_step(run_dir), config.trainer.max_steps
    if total is not None and done is not None and done >= total:
        raise ResumeError(
            f"trainer.resume={resume}: that run finished all its {total} optimizer steps; "
            "nothing is left to resume"
        )
    return ResumePoint(run_dir, record["run_id"], record["tracking_uri"], record["job"], config)


class TrainState:
    """The checkpointed state of a job (see the module docstring); `save(step)` after optimizer
    step `step`, `restore()` -> the steps done."""

    def __init__(self, run_dir: Path, model, optimizer, iterator, pruner, every: int, stop=None):
        import logging

        import tensorflow as tf

        # TensorFlow logs "Sharding callback duration" at INFO through absl on every save,
        # which Hydra's logging prints between the progress bar's updates.
        logging.getLogger("absl").setLevel(logging.WARNING)

        self.every, self.run_dir, self.iterator = every, run_dir, iterator
        self.stop: StopOnSignal | None = stop  # installed for the whole job by runner.train
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
