"""How a graph model's step holds memory over time beside its activations, for the backward
walk (runner/estimate/graph_walk.py): the Timeline it adds each tensor's bytes to, how
TensorFlow's executor runs the step (Executor: its updates, convolution kernels and what a
waiting step holds), and the weight gradients and slot products that are in flight at each
moment of the backward pass."""

import math
from dataclasses import dataclass


class Timeline:
    """Bytes alive at each operation's backward (index i), added over ranges of i."""

    def __init__(self, n: int):
        self.delta = [0] * (n + 1)

    def add(self, first: int, last: int, nbytes: int) -> None:
        if first <= last and nbytes:
            self.delta[first] += nbytes
            self.delta[last + 1] -= nbytes

    def values(self) -> list[int]:
        out, running = [], 0
        for d in self.delta[:-1]:
            running += d
            out.append(running)
        return out


@dataclass(frozen=True)
class Executor:
    """How TensorFlow's executor runs this step, beyond the layers' own rules.

    slots: weight-gradient updates running at once during the backward pass, in a step that
    applies them as they come (runner/techniques/accumulation.py's accum=1 step: a
    variable's update starts as soon as its gradient exists); the executor's inter-op
    threads; 0: gradients not modelled here. per_byte: bytes an update holds per byte of its
    float32 gradient, the gradient included.
    conv_threads: the intra-op threads of the CPU convolution kernels whose im2col buffers
    runner/estimate/conv_scratch.py sizes; 0: other kernels (oneDNN, XLA, a GPU).
    cpu_xla: the step is compiled by XLA for a CPU (layer_rules.grouped_conv_bytes).
    slot_products: when each float32 product of an update that reads only the optimizer's
    slots (SGD's momentum x m, runner/estimate/executor_rules.py) dies: "as_they_come" (its
    variable's update, started by its gradient), "at_the_end" (after the backward: a loss-scaled
    step checks every gradient first); "" none. The executor computes them all when the step
    starts, as it casts the kernels.
    waits_for: bytes a step that waits for every weight gradient before it applies any (a
    loss-scaled step checks them all, a step under a strategy all-reduces them) holds once its
    backward has ended: all of them, with their quotients or their pack
    (estimate._gradient_bytes); 0: a step that does not wait. While it waits, each float32
    gradient is held from its layer's backward on."""

    slots: int = 0
    per_byte: float = 1.0
    conv_threads: int = 0
    cpu_xla: bool = False
    slot_products: str = ""
    waits_for: int = 0


def _gradient_bytes(op) -> int:
    """Bytes of a layer's float32 weight gradients (of its trainable weights)."""
    return sum(math.prod(v.shape) for v in getattr(op, "trainable_weights", [])) * 4


def _first_calls(ops) -> list:
    """(index, layer) of each layer's first call: a layer called twice (shared weights) has one
    gradient, complete at its first call's backward, the last of its calls' to run."""
    seen, first = set(), []
    for i, op, _, _ in ops:
        if id(op) not in seen:
            seen.add(id(op))
            first.append((i, op))
    return first


def slot_products(ops, n: int, executor: Executor) -> tuple[Timeline, int]:
    """The slot products (Executor.slot_products) alive at each moment of the backward pass,
    and all of them (alive through the forward pass)."""
    timeline, total = Timeline(n), 0
    if not executor.slot_products:
        return timeline, total
    for i, op in _first_calls(ops):
        nbytes = _gradient_bytes(op)
        timeline.add(i if executor.slot_products == "as_they_come" else 0, n - 1, nbytes)
        total += nbytes
    return timeline, total


def in_flight(ops, n: int, executor: Executor) -> Timeline:
    """Each layer's float32 weight gradient, born at its backward, held with its update's
    temporaries until `slots` later weight gradients have been born (the update then done);
    the last `slots` are still updating when the backward ends (position 0)."""
    timeline = Timeline(n)
    if not executor.waits_for and not executor.slots:
        return timeline
    first = _first_calls(ops)
    # A shared layer's later calls: each call's share of its gradient, held from that call's
    # backward until its first call's, where TensorFlow adds them into the gradient.
    starts = {id(op): i for i, op in first}
    for i, op, _, _ in ops:
        if starts[id(op)] != i:
            timeline.add(starts[id(op)], i, _gradient_bytes(op))
    if executor.waits_for:  # each held from its backward until the step ends
        for i, op in first:
            timeline.add(0, i, _gradient_bytes(op))
        return timeline
    born = [(i, _gradient_bytes(op)) for i, op in reversed(first) if _gradient_bytes(op)]
    for k, (i, nbytes) in enumerate(born):
        later = k + executor.slots
        done = born[later][0] + 1 if later < len(born) else 0
        timeline.add(done, i, int(nbytes * executor.per_byte))
    return timeline
