"""The training loop: one readable loop over optimizer steps around the compiled step.

Each step's wall time is split into the wait for data (`next(iterator)`) and compute
(the step call, synchronised by reading the loss back), which model.fit does not expose.
"""

import math
import time
from dataclasses import dataclass, field

import keras

from runner.data import Data
from runner.tracking import Tracker


@dataclass
class History:
    losses: list[float] = field(default_factory=list)  # mean train loss per optimizer step
    wait_s: list[float] = field(default_factory=list)  # waiting for the input pipeline
    compute_s: list[float] = field(default_factory=list)  # the compiled step, loss read back
    evals: list[tuple[int, dict]] = field(default_factory=list)


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
    data: Data,
    total_steps: int,
    tracker: Tracker,
    eval_every: int,
    progress: bool,
) -> History:
    """Run total_steps optimizer steps; evaluate every eval_every steps (0: only at the end)."""
    history = History()
    bar = keras.utils.Progbar(total_steps, stateful_metrics=["loss"]) if progress else None
    iterator = iter(data.train)
    for step in range(1, total_steps + 1):
        start = time.perf_counter()
        xs, ys = next(iterator)
        fetched = time.perf_counter()
        loss = float(train_step(xs, ys))
        history.wait_s.append(fetched - start)
        history.compute_s.append(time.perf_counter() - fetched)
        history.losses.append(loss)
        tracker.log_metrics({"train/loss": loss}, step)
        if not math.isfinite(loss):
            raise FloatingPointError(f"train/loss is {loss} at optimizer step {step}")
        if (eval_every and step % eval_every == 0) or step == total_steps:
            metrics = eval_fn()
            history.evals.append((step, metrics))
            tracker.log_metrics(metrics, step)
        if bar is not None:
            bar.update(step, [("loss", loss)])
    return history
