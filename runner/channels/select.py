"""Which channels of each group a structured pruning keeps: each channel scored by its
group's weights (importance), the lowest removed, the count kept a multiple of what kernels
like (round_to) and of the group's blocks.

A channel's score is the sum, over every weight position of its group (its producer's
filter, its BatchNorm's entries, the next layers' input rows), of the element's importance:
|w| (l1), w^2 (l2), or |w x dL/dw| summed over training steps (taylor; Molchanov et al.,
"Importance Estimation for Neural Network Pruning", CVPR 2019), which the caller accumulates.
"""

import math
from collections.abc import Callable

import numpy as np

from runner.channels.walk import Analysis

Position = Callable[[str, int, int], np.ndarray]  # (layer, weight, axis) -> a score each


def scores(a: Analysis, position: Position) -> dict[int, np.ndarray]:
    """Each prunable group's channel scores: `position(layer name, weight index, axis)` is the
    importance of each position along that axis of that weight, summed over the others."""
    out = {g: np.zeros(a.groups[g].size) for g in a.prunable()}
    for s in a.slots:
        per_position = position(s.layer, s.weight, s.axis)
        roots = np.array([a.find(int(g)) for g in s.group])
        for root in set(roots.tolist()) & out.keys():
            here = roots == root
            np.add.at(out[root], s.index[here], per_position[here])
    return out


def by_position(element: Callable[[str, int], np.ndarray]) -> Position:
    """Per-position scores from `element(layer name, weight index)`, the importance of every
    element of that weight (|w|, w^2)."""

    def position(layer: str, weight: int, axis: int) -> np.ndarray:
        value = element(layer, weight)
        return np.moveaxis(value, axis, 0).reshape(value.shape[axis], -1).sum(1)

    return position


def kept_count(size: int, fraction: float, unit: int) -> int:
    """How many of `size` channels stay at `fraction` removed: the largest multiple of `unit`
    within size x (1 - fraction), so at least the fraction goes, and at least one unit; all of
    them where a group has no more than one unit, or at fraction 0 (nothing is to go)."""
    if size <= unit or fraction <= 0:
        return size
    return min(size, max(unit, unit * math.floor(size * (1 - fraction) / unit + 1e-9)))


def choose(
    a: Analysis, score: dict[int, np.ndarray], fraction: float, round_to: int
) -> dict[int, np.ndarray]:
    """The indices each prunable group keeps: its highest-scoring blocks (a block is one
    channel but in a GroupNormalization's group), as many channels as kept_count allows with a
    unit of round_to channels (an index of a head is key_dim of them) and of one block."""
    kept = {}
    for g, s in score.items():
        group = a.groups[g]
        per_index = round_to // math.gcd(round_to, group.width)  # indices to round_to channels
        unit = math.lcm(per_index, group.block)
        count = kept_count(group.size, fraction, unit)
        blocks = s.reshape(-1, group.block).sum(1)
        best = np.sort(np.argsort(-blocks, kind="stable")[: count // group.block])
        kept[g] = (best[:, None] * group.block + np.arange(group.block)).ravel()
    return kept
