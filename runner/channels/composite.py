"""The channel analysis's rules for layers with groups inside them: a GroupNormalization's
groups, a MultiHeadAttention's heads, models/transformer.py's block (heads and MLP units)."""

import math

import numpy as np

from runner.channels.walk import Walk, reads, untouched


def group_norm(w: Walk, layer, channel_map, live: set, out) -> None:
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
        untouched(w, layer, [channel_map], [out], f"{layer.name}'s groups span other groups")
    for weight in (layer.gamma, layer.beta):
        if weight is not None:
            w.slot(layer, weight, 0, channel_map)
    w.give(out, channel_map, () if layer.scale and layer.center else live)


def head_group(w: Walk, owner, attn) -> tuple[np.ndarray, np.ndarray]:
    """A MultiHeadAttention's whole heads as a group: its query, key and value projections'
    kernels (d, heads, key_dim) and biases, and its output projection's kernel (heads, key_dim,
    out). A head masked to zero attends uniformly over zero values: its context is zero."""
    heads = w.new(attn.num_heads, "")
    w.a.groups[int(heads[0][0])].width = attn._key_dim
    for dense in (attn._query_dense, attn._key_dense, attn._value_dense):
        w.slot(owner, dense.kernel, 1, heads)
        if dense.bias is not None:
            w.slot(owner, dense.bias, 0, heads)
    w.slot(owner, attn._output_dense.kernel, 0, heads)
    return heads


def attention(w: Walk, node, attn, out) -> None:
    """keras.layers.MultiHeadAttention(query, value, key=value): its heads a group; what it
    reads, the projections' input rows; its output, a group its output projection makes."""
    args, kwargs = node.arguments.args, node.arguments.kwargs
    query = args[0]
    value = args[1] if len(args) > 1 else kwargs["value"]
    key = kwargs.get("key") if kwargs.get("key") is not None else value
    for t, dense in (
        (query, attn._query_dense),
        (key, attn._key_dense),
        (value, attn._value_dense),
    ):
        reads(w, attn, t, dense.kernel, 0)
    w.a.heads[attn.name] = int(head_group(w, attn, attn)[0][0])
    output = attn._output_dense
    w.give(out, w.produce(attn, out.shape[-1], output.kernel, output.bias), ())


def block(w: Walk, block, x, out) -> None:
    """models/transformer.py's block: whole heads (query, key, value and output projections
    together) and the MLP's hidden units are groups of their own; the residual width passes
    through, whole (its LayerNorms normalise across it). A head masked to zero attends
    uniformly over zero values: its context is zero."""
    w.pin(set(w.maps[id(x)][0].tolist()), f"{block.name}'s LayerNorms normalise across it")
    made = head_group(w, block, block.attn)
    hidden = w.new(block.mlp_units, "")
    w.slot(block, block.mlp_up.kernel, 1, hidden)
    w.slot(block, block.mlp_up.bias, 0, hidden)
    w.slot(block, block.mlp_down.kernel, 0, hidden)
    w.a.blocks[block.name] = (int(made[0][0]), int(hidden[0][0]))
    w.give(out, w.maps[id(x)], w.live[id(x)])
