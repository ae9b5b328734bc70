"""pruning=structured across a run: masks chosen between two steps, the removal after
end_step, and a resume that finds the smaller model in its checkpoints.

After optimizer step end_step the ChannelPruner rebuilds the model without its masked
channels (runner/techniques/structured.py). The job then takes the small model on:
checkpointing's wrapper made again around it, the optimizer with its state carried over, the
compiled steps made again (runner/train/compiled.py: accumulation, precision and XLA as
before), and the checkpoint bound to the new variables. A marker, <run dir>/
channels_removed.json, holds the step, the kept channels and the large model's size; it is
written before the first checkpoint of the small model, so a resume whose last checkpoint is
from end_step on rebuilds the small model's structure first (its channels from the marker)
and restores into it. A removal that fails leaves the run FAILED with its reason, the
checkpoints before it kept.
"""

import gc
import json
import os

import tensorflow as tf

from runner.core.errors import ModelError
from runner.measure.flops import graph_forward_flops
from runner.techniques import checkpointing
from runner.techniques.structured import ChannelPruner
from runner.track.rundir import CHECKPOINTS
from runner.train.compiled import Compiled
from runner.train.job import Built, Job

MARKER = "channels_removed.json"


def _take(job: Job, built: Built, small, optimizer) -> None:
    """The job trains `small` with `optimizer` from here on."""
    cfg = job.cfg.checkpointing
    trained, remat = checkpointing.apply(small, cfg.policy, cfg.every)
    built.model, built.trained, built.remat, built.optimizer = small, trained, remat, optimizer


class Removal:
    """The loop's hook after each optimizer step (Steps.after_step)."""

    def __init__(self, job: Job, built: Built, state, compiled: Compiled):
        self.job, self.built, self.state, self.compiled = job, built, state, compiled

    @property
    def pruner(self) -> ChannelPruner:
        return self.built.pruner

    def after_step(self, step: int) -> None:
        if step == self.pruner.end and not self.pruner.removed:
            self.remove(step)
        else:
            self.pruner.choose(step + 1)

    def remove(self, step: int) -> None:
        b, job = self.built, self.job
        before = {
            "params": b.model.count_params(),
            "flops": graph_forward_flops(b.model, b.data.spec),
        }
        try:
            small, optimizer = self.pruner.remove(b.optimizer)
            _take(job, b, small, optimizer)
        except Exception as err:  # the run is FAILED with this line; its checkpoints stay
            why = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"
            raise ModelError(
                f"pruning=structured: the model could not be rebuilt without its masked "
                f"channels after optimizer step {step} ({why}); the run's checkpoints are kept "
                f"in {job.run_dir / CHECKPOINTS}"
            ) from err
        marker = {"step": step, "kept": self.pruner.kept_json(), "before": before}
        path = job.run_dir / MARKER
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(marker))
        os.replace(path.with_suffix(".tmp"), path)  # whole, or not at all
        self.compiled.make()
        self.state.rebind(small, optimizer, self.pruner)
        gc.collect()  # the large model's variables, held in cycles of its layers
        print(
            f"tfmemlab: removed the masked channels after optimizer step {step}: "
            f"{before['params']:,} -> {small.count_params():,} parameters",
            flush=True,
        )


def marker(job: Job) -> dict | None:
    path = job.run_dir / MARKER
    return json.loads(path.read_text()) if path.exists() else None


def resume_removed(job: Job, built: Built) -> None:
    """Before a resume restores: if the last checkpoint is of the small model (from the
    removal's step on), the job's model is rebuilt to its structure."""
    saved = marker(job)
    latest = tf.train.latest_checkpoint(str(job.run_dir / CHECKPOINTS))
    if saved is None or latest is None or int(latest.rsplit("-", 1)[1]) < saved["step"]:
        return
    small, optimizer = built.pruner.remove(built.optimizer, saved["kept"])
    _take(job, built, small, optimizer)
    gc.collect()
