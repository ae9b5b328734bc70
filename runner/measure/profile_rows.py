"""The per-layer profile's rows (issue 14, runner/measure/profile.py): the model as Sublayers,
one per Keras layer, or per sublayer of a layer that describes itself (the transformer block's
`sublayers`), and the loss; which rows' outputs the backward pass keeps; and each row's static
columns (output shape, parameters, forward FLOPs, bytes read and written, activation bytes),
by runner/estimate/layer_rules.py's rules.
"""

import math
from collections.abc import Callable

import keras
import tensorflow as tf

from models.common import Sublayer
from runner.estimate import layer_rules, model_graph


def _call_node(op, node) -> Callable:
    """op's call on its functional node, with concrete tensors in place of the Keras ones."""
    keras_tensors = node.arguments.keras_tensors
    training = {"training": True} if getattr(op, "_call_has_training_arg", False) else {}

    def call(*tensors):
        args, kwargs = node.arguments.fill_in(
            {id(k): t for k, t in zip(keras_tensors, tensors, strict=True)}
        )
        return op(*args, **{**kwargs, **training})  # a recorded training=None is overridden

    return call


def _key(name: tuple) -> str:
    """A tensor's name in the profile's dataflow, from model_graph's."""
    return "t" + "_".join(map(str, name))


def input_key(model: keras.Model) -> str:
    """The name of the model's (first) input in model_rows' dataflow."""
    return _key((0, id(model.inputs[0])))


def model_rows(model: keras.Model, batch: int, seq: int | None) -> list[Sublayer]:
    """The calls of the model's layers in order (runner/estimate/model_graph.py: a nested
    model's own, a shared layer's at each call, named <layer>@2 from its second) as Sublayers,
    with layers that describe themselves (a `sublayers` method) expanded, and the loss as the
    last row; the model's input is named input_key(model)."""
    rows, seen = [], {}
    calls, outputs = model_graph.calls(model)
    for node, op, ins, outs in calls:
        inputs, output = tuple(map(_key, ins)), _key(outs[0])
        if hasattr(op, "sublayers"):
            rows += op.sublayers(inputs[0], output, batch, seq)
            continue
        seen[id(op)] = seen.get(id(op), 0) + 1
        name = op.name if seen[id(op)] == 1 else f"{op.name}@{seen[id(op)]}"
        out_shape = node.outputs[0].shape
        out_elements = batch * math.prod(out_shape[1:])
        flops = layer_rules.kernel_flops(op, out_elements, out_shape[-1])
        activation = model_graph.own_activation(op)
        if activation and flops is not None:  # and its own activation's, on its output
            flops += layer_rules.element_flops(activation, 1, out_elements, out_elements)
        variables = getattr(op, "trainable_variables", [])
        call, kind = _call_node(op, node), layer_rules.kind(op)
        rows.append(
            Sublayer(name, kind, call, inputs, output, variables, flops, activation=activation)
        )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    logits = (_key(outputs[0]), "targets")
    rows.append(Sublayer("loss", "loss", lambda z, y: loss_fn(y, z), logits, "", []))
    return rows


def kept_outputs(rows: list[Sublayer], half: bool = False) -> set[str]:
    """Names of the rows whose output the backward pass keeps (see the module docstring).

    half: a 16-bit policy, under which Keras's BatchNormalization and LayerNormalization
    compute in float32 on a copy of their input: they keep that copy (describe counts it),
    not their 16-bit input.
    """
    readers_keep = layer_rules.input_keepers(half)
    readers = {}
    for row in rows:
        for name in row.inputs:
            readers.setdefault(name, []).append(row.kind)
    return {
        row.name
        for row in rows
        if row.kind in layer_rules.KEEPS_OUTPUT
        or row.activation in layer_rules.KEEPS_OUTPUT
        or any(k in readers_keep for k in readers.get(row.output, []))
    }


def _nbytes(t) -> int:
    return t.shape.num_elements() * t.dtype.size


def describe(row: Sublayer, inputs: list, output, kept: bool) -> dict:
    """A row's static columns from its concrete input and output tensors."""
    out_elements = output.shape.num_elements()
    in_elements = sum(t.shape.num_elements() for t in inputs)
    flops, extra = row.flops, row.extra_kept
    if row.kind == "loss":
        # Per logit: softmax and cross-entropy; the loss keeps the float32 gradient it
        # computes with the loss (softmax - one-hot), not the logits (measured: 1.00x).
        logits = inputs[0].shape.num_elements()
        flops, extra = layer_rules.FLOPS_PER_ELEMENT["loss"] * logits, extra + 4 * logits
    if flops is None:
        flops = layer_rules.element_flops(row.kind, len(inputs), in_elements, out_elements)
    half = inputs[0].dtype in (tf.float16, tf.bfloat16)
    scaled = any(v.name == "gamma" for v in row.variables)
    width = output.dtype.size
    extra += layer_rules.own_kept_bytes(row.kind, out_elements, in_elements, width, half, scaled)
    if row.activation:  # what its own activation's gradient keeps of its own
        extra += layer_rules.own_kept_bytes(
            row.activation, out_elements, out_elements, width, half, 0
        )
        extra += out_elements * width * (row.activation in layer_rules.KEEPS_INPUT)
    if row.kind == "Dropout":
        extra += out_elements  # its boolean keep-mask (tf.nn's dropout selects with it)
    weights = sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in row.variables)
    written = _nbytes(output)
    read = sum(_nbytes(t) for t in inputs) + weights
    return {
        "name": row.name,
        "type": row.kind,
        "output_shape": "x".join(str(d) for d in output.shape),
        "params": sum(math.prod(v.shape) for v in row.variables),
        "activation_bytes": (written if kept else 0) + extra,
        "forward_flops": float(flops),
        "bytes_read": read,
        "bytes_written": written,
        "intensity": float(flops) / (read + written) if read + written else 0.0,
    }
