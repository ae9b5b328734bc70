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
model's input and outputs, and every layer kind without a rule (kinds.py's lists, the
rules below and composite.py's), which is left whole and named in `untouched`.
"""

import keras
import numpy as np

from models.transformer import TransformerBlock
from runner.channels.composite import attention, block, group_norm
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
from runner.channels.walk import Analysis, Walk, last, reads, untouched


def _nodes(model) -> list:
    """The model's calls of its layers, from the inputs on."""
    rows = [(depth, node) for depth, row in model._nodes_by_depth.items() for node in row]
    rows.sort(key=lambda row: -row[0])
    return [node for _, node in rows if not node.is_input]


def channel_groups(model) -> Analysis:
    """The channel groups of a functional `model` (module docstring)."""
    w = Walk()
    for t in keras.tree.flatten(model.inputs):
        w.give(t, w.new(t.shape[-1], "", "the model's input"), ())
    for node in _nodes(model):
        ins = node.arguments.keras_tensors
        outs = keras.tree.flatten(node.outputs)
        _step(w, node, ins, outs)
    for t in keras.tree.flatten(model.outputs):
        w.pin(set(w.maps[id(t)][0]), "the model's output")
    return w.a


def _step(w: Walk, node, ins: list, outs: list) -> None:
    layer = node.operation
    maps = [w.maps[id(t)] for t in ins]
    live = [w.live[id(t)] for t in ins]
    out = outs[0]
    if len(layer._inbound_nodes) > 1:  # shared weights: each call would slice them its way
        untouched(w, layer, maps, outs, f"{layer.name} is called more than once", True)
        return

    def give(channel_map, alive) -> None:
        w.give(out, channel_map, alive)

    if isinstance(layer, CONV) and layer.groups == 1 or isinstance(layer, keras.layers.Dense):
        reads(w, layer, ins[0], layer.kernel, -2)
        made = w.produce(layer, out.shape[-1], layer.kernel, layer.bias)
        give(made, set() if zero_preserving(layer.activation) else {int(made[0][0])})
    elif isinstance(layer, keras.layers.DepthwiseConv2D) and layer.depth_multiplier == 1:
        w.slot(layer, layer.kernel, -2, maps[0])
        if layer.use_bias:
            w.slot(layer, layer.bias, 0, maps[0])
        alive = live[0] if zero_preserving(layer.activation) else set(maps[0][0].tolist())
        give(maps[0], alive)
    elif isinstance(layer, keras.layers.BatchNormalization) and last(layer.axis, out):
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
    elif isinstance(layer, keras.layers.Concatenate) and last(layer.axis, out):
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
    elif isinstance(layer, NORMS) and last(getattr(layer, "axis", -1), out):
        untouched(w, layer, maps, outs, f"{layer.name} normalises across the channels")
        give(maps[0], set())
    elif isinstance(layer, keras.layers.GroupNormalization) and last(layer.axis, out):
        group_norm(w, layer, maps[0], live[0], out)
    elif isinstance(layer, TransformerBlock):
        block(w, layer, ins[0], out)
    elif isinstance(layer, keras.layers.MultiHeadAttention):
        attention(w, node, layer, out)
    else:
        untouched(w, layer, maps, outs)
