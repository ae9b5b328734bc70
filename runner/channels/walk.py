"""The state of the channel analysis (runner/channels/groups.py): the groups, the weight
positions each indexes, the union-find that merges them, each tensor's channel map, and the
steps every rule shares (a layer reading channels, a layer left whole)."""

import math
from dataclasses import dataclass, field

import numpy as np

from models.common import is_graph


@dataclass
class Group:
    """`size` channels removed together: entry j of each slot's index."""

    size: int
    made_by: list[str] = field(default_factory=list)  # the layers whose outputs they are
    pinned: str = ""  # why none of them may be removed ("": they may)
    block: int = 1  # removed in aligned blocks of this many (a GroupNormalization's groups)
    width: int = 1  # channels one index stands for (a head: its key_dim)


@dataclass
class Slot:
    """Positions along one axis of one weight: position p is channel index[p] of group[p]."""

    layer: str
    weight: int  # the index in layer.weights
    axis: int
    group: np.ndarray
    index: np.ndarray


@dataclass
class Analysis:
    groups: list[Group]
    slots: list[Slot]
    parent: list[int]  # union-find over the groups' ids
    untouched: dict[str, str] = field(default_factory=dict)  # layer name -> why left whole
    # layers whose config names the channel count (a Reshape's target): name -> its input's map
    widths: dict[str, tuple] = field(default_factory=dict)
    # transformer blocks: name -> (the group of its heads, the group of its MLP's hidden units)
    blocks: dict[str, tuple[int, int]] = field(default_factory=dict)
    # keras MultiHeadAttention layers: name -> the group of its heads
    heads: dict[str, int] = field(default_factory=dict)
    # GroupNormalizations: name -> (the group it normalises, channels in one of its groups)
    norm_groups: dict[str, tuple[int, int]] = field(default_factory=dict)

    def find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def roots(self) -> list[int]:
        """The groups' ids after merging, in the order they were made."""
        return [g for g in range(len(self.groups)) if self.find(g) == g]

    def prunable(self) -> list[int]:
        return [g for g in self.roots() if not self.groups[g].pinned]


class Walk:
    """The state of one walk through the graph: the analysis, and each tensor's channel map
    (group ids, indices) and the groups not zero when masked in it."""

    def __init__(self):
        self.a = Analysis([], [], [])
        self.maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.live: dict[int, set[int]] = {}  # tensor -> groups whose masked channels are not 0

    def new(self, size: int, made_by: str, pinned: str = "") -> tuple[np.ndarray, np.ndarray]:
        g = len(self.a.groups)
        self.a.groups.append(Group(size, [made_by] if made_by else [], pinned))
        self.a.parent.append(g)
        return np.full(size, g), np.arange(size)

    def pin(self, groups, why: str) -> None:
        for g in groups:
            root = self.a.groups[self.a.find(int(g))]
            root.pinned = root.pinned or why

    def give(self, t, channel_map, live) -> None:
        """Tensor t's channels are `channel_map`; `live`, the groups not zero in it when masked."""
        self.maps[id(t)], self.live[id(t)] = channel_map, set(live)

    def produce(self, layer, size: int, kernel, bias) -> tuple[np.ndarray, np.ndarray]:
        """A new group of `size` channels that `layer` makes: its kernel's last axis and its
        bias (None: none) index them."""
        made = self.new(size, layer.name)
        self.slot(layer, kernel, -1, made)
        if bias is not None:
            self.slot(layer, bias, 0, made)
        return made

    def slot(self, layer, weight, axis: int, channel_map) -> None:
        index = [id(w) for w in layer.weights].index(id(weight))
        self.a.slots.append(Slot(layer.name, index, axis % len(weight.shape), *channel_map))

    def union(self, one, two, why: str) -> None:
        """The channels of `one` and `two` (maps) are the same channels, position by position."""
        (g1, i1), (g2, i2) = one, two
        if len(g1) != len(g2) or not np.array_equal(i1, i2):
            self.pin({*g1, *g2}, why)
            return
        for a, b in {(int(x), int(y)) for x, y in zip(g1, g2, strict=True)}:
            ra, rb = self.a.find(a), self.a.find(b)
            if ra == rb:
                continue
            big, small = self.a.groups[ra], self.a.groups[rb]
            if big.size != small.size:
                self.pin({ra, rb}, why)
                continue
            self.a.parent[rb] = ra
            big.made_by += small.made_by
            big.pinned = big.pinned or small.pinned
            big.block = math.lcm(big.block, small.block)


def last(axis, out) -> bool:
    """Whether `axis` (or one of a list of them) is the layer's output's last, the channels."""
    axes = axis if isinstance(axis, list | tuple) else [axis]
    return any(a in (-1, len(out.shape) - 1) for a in axes)


def reads(w: Walk, layer, t, weight, axis: int) -> None:
    """`layer` reads tensor t's channels along `axis` of `weight` (its input rows)."""
    live = w.live[id(t)]
    w.pin(live, f"not zero when masked where {layer.name} reads it")
    w.slot(layer, weight, axis, w.maps[id(t)])


def untouched(w: Walk, layer, maps: list, outs: list, why: str = "", name=False) -> None:
    """A layer the analysis does not follow: its inputs' groups and its outputs stay whole.
    It is named where that keeps channels whole that could have gone (or `name`)."""
    why = why or (
        f"nested model {layer.name} (not followed)"
        if is_graph(layer)
        else f"{type(layer).__name__} {layer.name} (no rule)"
    )
    groups = {w.a.find(int(g)) for channel_map in maps for g in channel_map[0]}
    if name or is_graph(layer) or any(not w.a.groups[g].pinned for g in groups):
        w.a.untouched[layer.name] = why  # named where it keeps channels whole that could go
    w.pin(groups, why)
    for t in outs:
        w.give(t, w.new(t.shape[-1], layer.name, why), ())
