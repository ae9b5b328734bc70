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
from dataclasses import dataclass, field

import keras
import tensorflow as tf

from runner.data import Data
from runner.measure.telemetry import Memory
from runner.resume import Interrupted, StopOnSignal, TrainState
from runner.track.tracking import Tracker


@dataclass
class History:
    losses: list[float] = field(default_factory=list)  # mean train loss per optimizer step
    wait_s: list[float] = field(default_factory=list)  # waiting for the input pipeline
    compute_s: list[float] = field(default_factory=list)  # the compiled step, loss read back
    evals: list[tuple[int, dict]] = field(default_factory=list)
    current_bytes: list[int] = field(default_factory=list)  # allocator bytes after each step
    step_peaks: list[int] = field(default_factory=list)  # allocator peak during each step
    # each local replica's allocator peak during each step (GPUs: one per replica)
    replica_peaks: list[list[int]] = field(default_factory=list)
    skipped_steps: int = 0  # updates skipped for non-finite gradients (float16 loss scaling)
    first_step: int = 1  # the optimizer step of losses[0]: after a resume, the one after it

    @property
    def last_step(self) -> int:
        return self.first_step + len(self.losses) - 1

    @property
    def first_step_peak(self) -> int:
        return self.step_peaks[0]

    @property
    def steady_peak(self) -> int:
        """Training steps after the first, evaluation excluded; a 1-step run has only its
        first step to report."""
        return max(self.step_peaks[1:] or self.step_peaks)

    @property
    def steady_replica_peaks(self) -> list[int]:
        """steady_peak of each local replica's allocator."""
        steady = self.replica_peaks[1:] or self.replica_peaks
        return [max(column) for column in zip(*steady, strict=True)]


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


def train(
    train_step,
    eval_fn,
    iterator,
    total_steps: int,
    tracker: Tracker,
    eval_every: int,
    progress: bool,
    mem: Memory,
    step_metrics=None,
    state: TrainState | None = None,
    first_step: int = 1,
) -> History:
    """Run optimizer steps first_step..total_steps on batches from `iterator`; evaluate every
    eval_every steps (0: only at the end).

    step_metrics: optional callable returning extra per-step metrics (the loss scale).
    state: checkpointed every state.every steps, and when SIGTERM/SIGINT arrives: the step
    under way finishes, its checkpoint is written, and Interrupted is raised (in a
    multi-worker job on every worker after the same step: state.workers).
    """
    history = History(first_step=first_step)
    bar = keras.utils.Progbar(total_steps, stateful_metrics=["loss"]) if progress else None
    wait = [0.0]

    def batches():
        """The pipeline's micro-batches, the time spent waiting for each added to wait[0]."""
        while True:
            start = time.perf_counter()
            batch = next(iterator)
            wait[0] += time.perf_counter() - start
            yield batch

    micro_batches = batches()
    with contextlib.ExitStack() as stack:
        stop = state.stop if state is not None and state.stop is not None else None
        stop = stop or stack.enter_context(StopOnSignal())
        for step in range(first_step, total_steps + 1):
            mem.reset()  # this step's peak is its own (a reset is cheap: no synchronisation)
            wait[0] = 0.0
            start = time.perf_counter()
            try:
                loss, finite = train_step(micro_batches)
                loss = float(loss)  # reading the loss back waits for the step to finish
            except tf.errors.ResourceExhaustedError as err:
                # Nothing is checkpointed from here: optimizer.iterations has advanced
                # without an update (shared GUIDE).
                err.tfmemlab_step = step
                raise
            history.wait_s.append(wait[0])
            history.compute_s.append(time.perf_counter() - start - wait[0])
            history.losses.append(loss)
            history.skipped_steps += not bool(finite)
            history.replica_peaks.append(mem.peaks())
            history.step_peaks.append(max(history.replica_peaks[-1]))
            history.current_bytes.append(mem.current())
            metrics = {
                "train/loss": loss,
                "mem/current_bytes": history.current_bytes[-1],
                "mem/step_peak_bytes": history.step_peaks[-1],
            }
            tracker.log_metrics({**metrics, **(step_metrics() if step_metrics else {})}, step)
            if not math.isfinite(loss):
                # The last checkpoint stays the last one: this step's state is not saved.
                raise FloatingPointError(f"train/loss is {loss} at optimizer step {step}")
            if (eval_every and step % eval_every == 0) or step == total_steps:
                metrics = eval_fn()
                history.evals.append((step, metrics))
                tracker.log_metrics(metrics, step)
            if bar is not None:
                bar.update(step, [("loss", loss)])
            last = step == total_steps and state is not None and state.every > 0
            workers = state.workers if state is not None else None
            alone = stop.signum and workers is None  # this process stops on its own
            if state is not None and (state.due(step) or alone or last):
                # Metrics first: a kill between the two then costs steps that run again
                # and are not logged twice (Tracker.logged), not steps lost for good.
                tracker.flush()
                state.save(step)
            if workers is not None and step < total_steps:
                workers.after_step(step)  # on a signal anywhere: all save, then Interrupted
            if alone:
                if state is None:
                    raise KeyboardInterrupt
                raise Interrupted(stop.signum, step, state.run_dir)
    mem.reset()  # keeps the RSS high-water read so far (Memory.peak_rss) past this reset
    return history
