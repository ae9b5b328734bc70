"""The training loop: one readable loop over optimizer steps around the compiled step.

Each step's wall time is split into the wait for data (the `accum` calls of
`next(iterator)` the step makes) and compute (the rest of the step, synchronised by reading
the loss back), which model.fit does not expose.
Memory is read per step: the allocator's peak is reset before each optimizer step and read
after it, so the first step (tracing, XLA compilation) is apart from the steady steps after
it, and evaluation stays out of the training peak.
"""

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import keras
import tensorflow as tf

from runner.core.errors import Interrupted, NonFiniteLoss
from runner.feed.pipelines import Data
from runner.measure.history import History
from runner.measure.telemetry import Memory
from runner.train.checkpoint import TrainState
from runner.train.signals import StopOnSignal


@dataclass
class Steps:
    """What the loop runs: optimizer steps `first`..`total` of `train_step(batches) -> (mean
    loss, finite)` on micro-batches from `batches`, evaluating every `eval_every` steps (0:
    only at the end); `step_metrics()` adds per-step metrics (the loss scale)."""

    train_step: Callable
    evaluate: Callable[[], dict]
    batches: Iterator
    total: int
    first: int = 1
    eval_every: int = 0
    progress: bool = True
    step_metrics: Callable[[], dict] | None = None
    after_step: Callable[[int], None] | None = None  # after a step's figures, before evaluation


def evaluate(eval_step, data: Data, max_batches: int | None) -> dict[str, float]:
    """Loss and accuracy over the validation split (or its first max_batches batches)."""
    loss_sum = correct = count = 0.0
    for i, (x, y) in enumerate(data.val):
        if max_batches is not None and i >= max_batches:
            break
        batch_loss, batch_correct, batch_count = eval_step(x, y)
        loss_sum += float(batch_loss)
        correct += float(batch_correct)
        count += float(batch_count)
    return {"val/loss": loss_sum / count, "val/accuracy": correct / count}


def train(steps: Steps, tracker, mem: Memory, state: TrainState | None = None) -> History:
    """Run `steps` (see Steps), logging each step's figures through `tracker`.

    state: checkpointed every state.every steps, and when SIGTERM/SIGINT arrives: the step
    under way finishes, its checkpoint is written, and Interrupted is raised (in a
    multi-worker job on every worker after the same step: state.workers).
    """
    history = History(first_step=steps.first)
    bar = keras.utils.Progbar(steps.total, stateful_metrics=["loss"]) if steps.progress else None
    wait = [0.0]
    finite: list = []  # this step's micro-batches: whether each one's inputs were finite

    def batches():
        """The pipeline's micro-batches, the time spent waiting for each added to wait[0]
        (with their inputs' check: 0.6 ms for 32 x 96 x 96 x 3 floats on a 2-core CPU)."""
        while True:
            start = time.perf_counter()
            batch = next(steps.batches)
            finite.append(inputs_finite(batch))
            wait[0] += time.perf_counter() - start
            yield batch

    micro_batches = batches()
    with contextlib.ExitStack() as stack:
        stop = state.stop if state is not None and state.stop is not None else None
        stop = stop or stack.enter_context(StopOnSignal())
        for step in range(steps.first, steps.total + 1):
            mem.reset()  # this step's peak is its own (a reset is cheap: no synchronisation)
            wait[0] = 0.0
            finite.clear()
            start = time.perf_counter()
            try:
                loss, applied = steps.train_step(micro_batches)
                loss = float(loss)  # reading the loss back waits for the step to finish
            except tf.errors.ResourceExhaustedError as err:
                # Nothing is checkpointed from here: optimizer.iterations has advanced
                # without an update (measured: docs/failures-and-resume.md).
                err.tfmemlab_step = step
                raise
            metrics = _record(history, mem, loss, applied, wait[0], time.perf_counter() - start)
            extra = steps.step_metrics() if steps.step_metrics else {}
            tracker.log_metrics({**metrics, **extra}, step)
            if not math.isfinite(loss):
                # The last checkpoint stays the last one: this step's state is not saved.
                raise NonFiniteLoss(loss, step, _all_finite(finite))
            if steps.after_step is not None:  # pruning=structured's choices and removal
                steps.after_step(step)
            if (steps.eval_every and step % steps.eval_every == 0) or step == steps.total:
                metrics = steps.evaluate()
                history.evals.append((step, metrics))
                tracker.log_metrics(metrics, step)
            if bar is not None:
                bar.update(step, [("loss", loss)])
            _checkpoint(step, steps.total, state, stop, tracker)
    mem.reset()  # keeps the RSS high-water read so far (Memory.peak_rss) past this reset
    return history


def inputs_finite(batch) -> list:
    """Whether each floating tensor of a micro-batch (each replica's part under a strategy) is
    finite: scalar tensors, read only when the loss is not. Reading them then tells bad data
    from a diverging model (issue 48). Token ids and labels are integers, never checked."""
    parts = []
    for t in tf.nest.flatten(batch):
        if isinstance(t, tf.distribute.DistributedValues):
            parts.extend(t.values)
        else:
            parts.append(t)
    return [
        tf.reduce_all(tf.math.is_finite(t))
        for t in parts
        if isinstance(t, tf.Tensor) and t.dtype.is_floating
    ]


def _all_finite(flags: list[list]) -> bool | None:
    """True when every checked input was finite, False when one was not, None when the step's
    micro-batches had no floating inputs."""
    checked = [bool(f) for step_flags in flags for f in step_flags]
    return all(checked) if checked else None


def _record(history: History, mem: Memory, loss, finite, wait_s: float, step_s: float) -> dict:
    """One step's figures into the history; returns those logged at every step."""
    history.wait_s.append(wait_s)
    history.compute_s.append(step_s - wait_s)
    history.losses.append(loss)
    history.skipped_steps += not bool(finite)
    history.replica_peaks.append(mem.peaks())
    history.step_peaks.append(max(history.replica_peaks[-1]))
    history.current_bytes.append(mem.current())
    return {
        "train/loss": loss,
        "mem/current_bytes": history.current_bytes[-1],
        "mem/step_peak_bytes": history.step_peaks[-1],
    }


def _checkpoint(step: int, total: int, state: TrainState | None, stop, tracker) -> None:
    """After optimizer step `step`: a checkpoint when one is due, or the last step, or on a
    signal; then, on a signal, Interrupted (in a multi-worker job, once all have saved)."""
    last = step == total and state is not None and state.every > 0
    workers = state.workers if state is not None else None
    alone = stop.signum and workers is None  # this process stops on its own
    if state is not None and (state.due(step) or alone or last):
        # Metrics first: a kill between the two then costs steps that run again and are not
        # logged twice (Tracker.logged), not steps lost for good.
        tracker.flush()
        state.save(step)
    if workers is not None and step < total:
        workers.after_step(step)  # on a signal anywhere: all save, then Interrupted
    if alone:
        if state is None:
            raise KeyboardInterrupt
        raise Interrupted(stop.signum, step, state.run_dir)
