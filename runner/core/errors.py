"""The errors tfmemlab raises for what the user can fix: each message is one line.

They live here, below everything, so that the command line can catch them by class (not by
name in a string) without importing the layer that raised them.
"""

import signal
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad config value: `str(err)` is the one line shown to the user."""

    def __init__(self, key: str, value: Any, allowed: str):
        super().__init__(f"{key}={value}: not allowed; expected {allowed}")
        self.key, self.value, self.allowed = key, value, allowed

    def __reduce__(self):
        # An error of a fresh process (a probe of accum=auto) comes back pickled; rebuilt from
        # its message alone, it would fail in the pool's result thread and the parent wait.
        return type(self), (self.key, self.value, self.allowed)


class ModelError(ValueError):
    """A model of the user's own (a `_target_` in its model YAML) cannot be built or does not
    fit the data: `str(err)` is the one line shown to the user."""


class PlanError(ValueError):
    """A memory budget cannot be met or read (runner.plan, accum=auto)."""


class ResumeError(ValueError):
    """trainer.resume cannot be honoured."""


class TrackingError(Exception):
    """The tracking store cannot be used; the message says what to do."""


class Interrupted(BaseException):
    """The job was stopped by a signal after a checkpoint (a BaseException, like
    KeyboardInterrupt: it is not the job's error)."""

    def __init__(self, signum: int, step: int, run_dir: Path, checkpoints: str = "checkpoints"):
        self.signum, self.step, self.run_dir = signum, step, run_dir
        self.exit_code = 128 + signum
        self.checkpoints = checkpoints
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after optimizer step {step}; its "
            f"checkpoint is in {run_dir / checkpoints}"
        )

    def __reduce__(self):  # pickled whole, as ConfigError is
        return type(self), (self.signum, self.step, self.run_dir, self.checkpoints)


class BusyError(RuntimeError):
    """A run directory or sweep folder is held by another process (runner/core/lock.py)."""

    exit_code = 75  # EX_TEMPFAIL: a sweep tells a job left to another process from a failure


class DiskFull(Exception):
    """A write of the run failed for want of space (ENOSPC, EDQUOT): not out of memory. Built by
    runner.core.diskfull; `then` says what the writer kept and how to go on."""

    def __init__(self, path, reason: str, free: int | None, then: str = ""):
        self.path, self.reason, self.free, self.then = path, reason, free, then
        left = "" if free is None else f"; {free / 2**20:.1f} MiB left on that filesystem"
        then = f". {then}" if then else ""
        super().__init__(f"disk full: writing {path} failed ({reason}){left}{then}")

    def __reduce__(self):  # pickled whole, as ConfigError is
        return type(self), (self.path, self.reason, self.free, self.then)


class NonFiniteLoss(FloatingPointError):
    """train/loss came back NaN or Inf (a FloatingPointError: the run's `failure` tag is nan).
    `inputs_finite`: whether every floating value of the step's micro-batches was finite (None
    when they had none, as token ids); `then` says what to try and what was kept."""

    def __init__(self, loss: float, step: int, inputs_finite: bool | None, then: str = ""):
        self.loss, self.step, self.inputs_finite, self.then = loss, step, inputs_finite, then
        seen = {
            False: ", and its input batch held NaN or Inf",
            True: " with finite inputs",
            None: "",
        }[inputs_finite]
        then = f": {then}" if then else ""
        super().__init__(f"train/loss is {loss} at optimizer step {step}{seen}{then}")

    def __reduce__(self):  # pickled whole, as ConfigError is
        return type(self), (self.loss, self.step, self.inputs_finite, self.then)


def error_line(err: BaseException) -> str:
    """A user's code's exception in one line: its type and its message's first line."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
