"""Which channels of a functional Keras model must be removed together, read from its graph.

A channel made by a convolution's filter or a Dense unit is read by every layer its tensor
reaches: a BatchNormalization's or a depthwise convolution's per-channel weights, the next
layer's input rows, the other side of a residual Add (whose producers then lose the same
channels), a place in a Concatenate's output. Those weights together are a channel group
(Fang et al., DepGraph, CVPR 2023): removing channel j of a group removes index j from each of
them. Each tensor's last axis is followed as a map, channel -> (group, index in the group).

A channel can be removed without changing what the model computes only where it is zero once
masked: its producer's weights zeroed, an activation f(0) = 0 keeps it zero (f is evaluated at
0), a BatchNormalization with zeroed gamma and beta outputs zero, a product with a zero is zero.
A channel that is not zero when masked (sigmoid(0) = 0.5) and reaches another layer's input
rows pins its group. So do a normalisation across channels (LayerNormalization, Softmax), the
model's input and outputs, and every layer kind not listed below, which is left whole and
named in `untouched`.
"""

import math
from dataclasses import dataclass, field

import keras
import numpy as np

from models.common import is_graph
from models.transformer import TransformerBlock
from runner.channels.kinds import (
    ACTIVATION,
    CONV,
    MERGE,
    NORMS,
    PRODUCT,
    SPATIAL,
    elementwise,
    zero_at_zero,
    zero_preserving,
)


@dataclass
class Group:
    """`size` channels removed together: entry j of each slot's index."""

    size: int
    made_by: list[str] = field(default_factory=list)  # the layers whose outputs they are
    pinned: str = ""  # why none of them may be removed ("": they may)
    block: int = 1  # removed in aligned blocks of this many (a GroupNormalization's groups)


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


class _Walk:
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


def _nodes(model) -> list:
    """The model's calls of its layers, from the inputs on."""
    rows = [(depth, node) for depth, row in model._nodes_by_depth.items() for node in row]
    rows.sort(key=lambda row: -row[0])
    return [node for _, node in rows if not node.is_input]


def channel_groups(model) -> Analysis:
    """The channel groups of a functional `model` (module docstring)."""
    w = _Walk()
    for t in keras.tree.flatten(model.inputs):
        w.maps[id(t)] = w.new(t.shape[-1], "", "the model's input")
        w.live[id(t)] = set()
    for node in _nodes(model):
        ins = node.arguments.keras_tensors
        outs = keras.tree.flatten(node.outputs)
        _step(w, node, ins, outs)
    for t in keras.tree.flatten(model.outputs):
        w.pin(set(w.maps[id(t)][0]), "the model's output")
    return w.a


def _last(axis, out) -> bool:
    """Whether `axis` (or one of a list of them) is the layer's output's last, the channels."""
    axes = axis if isinstance(axis, list | tuple) else [axis]
    return any(a in (-1, len(out.shape) - 1) for a in axes)


def _reads(w: _Walk, layer, t, weight, axis: int) -> None:
    """`layer` reads tensor t's channels along `axis` of `weight` (its input rows)."""
    live = w.live[id(t)]
    w.pin(live, f"not zero when masked where {layer.name} reads it")
    w.slot(layer, weight, axis, w.maps[id(t)])


def _step(w: _Walk, node, ins: list, outs: list) -> None:
    layer = node.operation
    maps = [w.maps[id(t)] for t in ins]
    live = [w.live[id(t)] for t in ins]
    out = outs[0]
    if len(layer._inbound_nodes) > 1:  # shared weights: each call would slice them its way
        _untouched(w, layer, maps, outs, f"{layer.name} is called more than once", True)
        return

    def give(channel_map, alive: set) -> None:
        w.maps[id(out)], w.live[id(out)] = channel_map, set(alive)

    if isinstance(layer, CONV) and layer.groups == 1 or isinstance(layer, keras.layers.Dense):
        _reads(w, layer, ins[0], layer.kernel, -2)
        made = w.new(out.shape[-1], layer.name)
        w.slot(layer, layer.kernel, -1, made)
        if layer.use_bias:
            w.slot(layer, layer.bias, 0, made)
        give(made, set() if zero_preserving(layer.activation) else {int(made[0][0])})
    elif isinstance(layer, keras.layers.DepthwiseConv2D) and layer.depth_multiplier == 1:
        w.slot(layer, layer.kernel, -2, maps[0])
        if layer.use_bias:
            w.slot(layer, layer.bias, 0, maps[0])
        alive = live[0] if zero_preserving(layer.activation) else set(maps[0][0].tolist())
        give(maps[0], alive)
    elif isinstance(layer, keras.layers.BatchNormalization) and layer.axis in (
        -1,
        len(out.shape) - 1,
    ):
        for weight in (layer.gamma, layer.beta, layer.moving_mean, layer.moving_variance):
            if weight is not None:
                w.slot(layer, weight, 0, maps[0])
        # gamma and beta zeroed: zero out, whatever came in; without them it passes on its input
        give(maps[0], live[0] if not (layer.scale and layer.center) else set())
    elif isinstance(layer, SPATIAL):
        give(maps[0], live[0])
    elif isinstance(layer, ACTIVATION) or elementwise(node) == "unary":
        zero = zero_at_zero(node)
        give(maps[0], live[0] if zero else live[0] | set(maps[0][0].tolist()))
    elif isinstance(layer, MERGE) or elementwise(node) == "merge":
        for other in maps[1:]:
            w.union(maps[0], other, f"{layer.name} merges channels that do not line up")
        give(maps[0], set().union(*live))
    elif isinstance(layer, PRODUCT) or elementwise(node) == "product":
        for other in maps[1:]:
            w.union(maps[0], other, f"{layer.name} multiplies channels that do not line up")
        give(maps[0], set.intersection(*live))
    elif isinstance(layer, keras.layers.Concatenate) and _last(layer.axis, out):
        give(tuple(np.concatenate(parts) for parts in zip(*maps, strict=True)), set().union(*live))
    elif isinstance(layer, keras.layers.Reshape) and out.shape[-1] == ins[0].shape[-1]:
        w.a.widths[layer.name] = maps[0]  # the channel axis stays last: (1, 1, C) after pooling
        give(maps[0], live[0])
    elif isinstance(layer, keras.layers.Flatten) and len(ins[0].shape) > 2:
        spatial = int(np.prod(ins[0].shape[1:-1]))  # channels last: position k x C + c
        give(tuple(np.tile(part, spatial) for part in maps[0]), live[0])
    elif isinstance(layer, keras.layers.Embedding):
        made = w.new(out.shape[-1], layer.name)  # its input is indices, not channels
        w.slot(layer, layer.embeddings, 1, made)
        give(made, set())
    elif isinstance(layer, NORMS) and _last(getattr(layer, "axis", -1), out):
        _untouched(w, layer, maps, outs, f"{layer.name} normalises across the channels")
        give(maps[0], set())
    elif isinstance(layer, keras.layers.GroupNormalization) and _last(layer.axis, out):
        _group_norm(w, layer, maps[0], live[0], out)
    elif isinstance(layer, TransformerBlock):
        _block(w, layer, ins[0], out)
    else:
        _untouched(w, layer, maps, outs)


def _group_norm(w: _Walk, layer, channel_map, live: set, out) -> None:
    """A GroupNormalization's statistics are its groups': a channel group loses whole ones
    (aligned blocks of C / groups channels), so the others' statistics stay, and the layer
    keeps as many groups as blocks are left. Gamma and beta zeroed: zero out."""
    groups, index = channel_map
    per, roots = len(index) // layer.groups, {w.a.find(int(g)) for g in groups}
    if len(roots) == 1 and np.array_equal(index, np.arange(len(index))):
        (root,) = roots
        w.a.groups[root].block = math.lcm(w.a.groups[root].block, per)
        w.a.norm_groups[layer.name] = (root, per)
    else:
        _untouched(w, layer, [channel_map], [out], f"{layer.name}'s groups span other groups")
    for weight in (layer.gamma, layer.beta):
        if weight is not None:
            w.slot(layer, weight, 0, channel_map)
    w.maps[id(out)] = channel_map
    w.live[id(out)] = set() if layer.scale and layer.center else set(live)


def _block(w: _Walk, block, x, out) -> None:
    """models/transformer.py's block: whole heads (query, key, value and output projections
    together) and the MLP's hidden units are groups of their own; the residual width passes
    through, whole (its LayerNorms normalise across it). A head masked to zero attends
    uniformly over zero values: its context is zero."""
    w.pin(set(w.maps[id(x)][0].tolist()), f"{block.name}'s LayerNorms normalise across it")
    attn = block.attn
    heads = w.new(block.heads, "")
    for dense in (attn._query_dense, attn._key_dense, attn._value_dense):
        w.slot(block, dense.kernel, 1, heads)
        w.slot(block, dense.bias, 0, heads)
    w.slot(block, attn._output_dense.kernel, 0, heads)
    hidden = w.new(block.mlp_units, "")
    w.slot(block, block.mlp_up.kernel, 1, hidden)
    w.slot(block, block.mlp_up.bias, 0, hidden)
    w.slot(block, block.mlp_down.kernel, 0, hidden)
    w.a.blocks[block.name] = (int(heads[0][0]), int(hidden[0][0]))
    w.maps[id(out)], w.live[id(out)] = w.maps[id(x)], set(w.live[id(x)])


def _untouched(w: _Walk, layer, maps: list, outs: list, why: str = "", name=False) -> None:
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
        w.maps[id(t)] = w.new(t.shape[-1], layer.name, why)
        w.live[id(t)] = set()
