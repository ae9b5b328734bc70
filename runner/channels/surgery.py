"""A functional model rebuilt without some of its channels (runner/channels/groups.py), and the
masked model the smaller one must equal.

The smaller model is a clone whose convolutions and Dense layers make only the kept channels
(`filters`, `units`), every other layer built from its new inputs; each weight is the old one
with, along each axis a group indexes, the kept positions taken in order. Masking is the other
way to the same function: every position of a removed channel set to zero in the large model.
"""

import keras
import numpy as np

from runner.channels.kinds import CONV
from runner.channels.walk import Analysis


def _gone(a: Analysis, groups: np.ndarray, index: np.ndarray, kept: dict) -> np.ndarray:
    """Of the channels (groups[p], index[p]), which are removed."""
    roots = np.array([a.find(int(g)) for g in groups])
    gone = np.zeros(len(roots), bool)
    for root in set(roots.tolist()):
        if root in kept:
            here = roots == root
            gone[here] = ~np.isin(index[here], kept[root])
    return gone


def removed_positions(a: Analysis, kept: dict[int, np.ndarray]) -> dict[tuple, np.ndarray]:
    """(layer name, weight index, axis) -> bool of each position along the axis: removed.
    `kept`: a group's id (a root) -> the indices it keeps; a group not in it keeps all."""
    out = {}
    for s in a.slots:
        gone = _gone(a, s.group, s.index, kept)
        key = (s.layer, s.weight, s.axis)
        out[key] = out[key] | gone if key in out else gone
    return out


def _sizes(a: Analysis, kept: dict[int, np.ndarray]) -> dict[str, int]:
    """Each producer's new output width (filters or units)."""
    sizes = {}
    for root, index in kept.items():
        for name in a.groups[root].made_by:
            sizes[name] = len(index)
    return sizes


def masked(model, a: Analysis, kept: dict[int, np.ndarray]):
    """A copy of `model` with every position of a removed channel set to zero."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    zero_removed(copy, a, kept)
    return copy


def zero_removed(model, a: Analysis, kept: dict[int, np.ndarray]) -> None:
    """Every position of a removed channel in `model`'s own weights set to zero (a pruner's
    masks applied)."""
    for (name, weight, axis), gone in removed_positions(a, kept).items():
        variable = model.get_layer(name).weights[weight]
        value = keras.ops.convert_to_numpy(variable).copy()
        where = [slice(None)] * value.ndim
        where[axis] = gone
        value[tuple(where)] = 0
        variable.assign(value)


def smaller(model, a: Analysis, kept: dict[int, np.ndarray]):
    """`model` rebuilt without the removed channels, its kept weights sliced in."""
    sizes = _sizes(a, kept)
    widths = {name: int((~_gone(a, *m, kept)).sum()) for name, m in a.widths.items()}

    def rebuild(layer):
        config = layer.get_config()
        if layer.name in sizes:
            width = "units" if isinstance(layer, keras.layers.Dense) else "output_shape"
            config["filters" if isinstance(layer, CONV) else width] = sizes[layer.name]
        if layer.name in a.heads:  # keras MultiHeadAttention: fewer heads of the same width
            config["num_heads"] = len(kept.get(a.find(a.heads[layer.name]), range(layer.num_heads)))
        if layer.name in widths:
            config["target_shape"] = (*config["target_shape"][:-1], widths[layer.name])
        if layer.name in a.norm_groups:  # as many groups as whole ones are left
            root, per = a.norm_groups[layer.name]
            config["groups"] = len(kept.get(a.find(root), range(per * layer.groups))) // per
        if layer.name in a.blocks:  # a transformer block: fewer heads of the same width
            heads, hidden = (a.find(g) for g in a.blocks[layer.name])
            config["key_dim"] = layer.key_dim
            config["heads"] = len(kept.get(heads, range(layer.heads)))
            config["mlp_units"] = len(kept.get(hidden, range(layer.mlp_units)))
        return type(layer).from_config(config)

    small = keras.models.clone_model(model, clone_function=rebuild)
    gone = removed_positions(a, kept)
    for old, new in zip(model.layers, small.layers, strict=True):
        for i, (before, after) in enumerate(zip(old.weights, new.weights, strict=True)):
            after.assign(_kept(before, old.name, i, gone))
    return small


def _kept(variable, name: str, index: int, gone: dict) -> np.ndarray:
    """The value of weight `index` of layer `name` (or of an optimizer's slot of it) without
    its removed positions."""
    value = keras.ops.convert_to_numpy(variable)
    for (layer, weight, axis), removed in gone.items():
        if layer == name and weight == index:
            value = np.take(value, np.flatnonzero(~removed), axis=axis)
    return value


def carry_optimizer(optimizer, model, small, a: Analysis, kept: dict[int, np.ndarray]):
    """A new optimizer of `optimizer`'s kind and settings for `small` (smaller(model, ...)),
    its state carried over: the step count, and each slot (Adam's moments) sliced as its
    variable was. A slot is its variable's by name (Keras names it "<optimizer>/<variable's
    path, / as _>_<slot>", the optimizer a LossScaleOptimizer's inner one); slots are listed in
    the variables' order in both."""
    new = type(optimizer).from_config(optimizer.get_config())
    new.build(small.trainable_variables)
    owner = {}  # a slot's name after its optimizer's -> (layer name, weight index) of its variable
    for layer in model.layers:
        for i, w in enumerate(layer.weights):
            owner.setdefault(f"{w.path.replace('/', '_')}_", (layer.name, i))
    gone = removed_positions(a, kept)
    for before, after in zip(optimizer.variables, new.variables, strict=True):
        if tuple(before.shape) == tuple(after.shape):
            after.assign(before)
            continue
        name = before.path.split("/", 1)[-1]
        prefix = max((p for p in owner if name.startswith(p)), key=len)  # dense_1_ over dense_
        after.assign(_kept(before, *owner[prefix], gone))
    return new
