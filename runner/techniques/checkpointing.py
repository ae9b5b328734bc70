"""Gradient checkpointing: recompute activations in the backward pass instead of keeping them.

Keras's RematScope fails on the TensorFlow backend (keras-team/keras#21207), so tfmemlab cuts
the functional graph at single-tensor boundaries between blocks (every transformer block,
MobileNet inverted residual, EfficientNet MBConv block), makes each run of k blocks a
sub-model sharing the original layers, and wraps it in `Remat`, which calls it through
`tf.recompute_grad`. Policies: `blocks` (k = 1), `sqrt` (k = ceil(sqrt(n)), Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost"), `every` (k = checkpointing.every).
"""

import math
import re
from dataclasses import dataclass, field

import keras
import tensorflow as tf

# Block names in keras.applications and models/transformer.py: block_3_expand (MobileNetV2),
# expanded_conv_2_add (MobileNetV3, V2's first block), block2a_dwconv (EfficientNet), block_0.
_BLOCK = re.compile(r"^(block_?\d+[a-z]?|expanded_conv(?:_\d+)?)(?:_|$)")


@dataclass
class RematInfo:
    """What was rematerialised, for the figures: segments of `length` blocks each."""

    policy: str = "none"
    blocks: int = 0
    length: int = 0
    # per segment: the names of the graph operations it recomputes, and its output's producer
    segment_ops: list[set[str]] = field(default_factory=list)
    segment_outputs: list[str] = field(default_factory=list)

    @property
    def segments(self) -> int:
        return len(self.segment_ops)


class Remat(keras.layers.Layer):
    """Runs `segment` under tf.recompute_grad, updating its state once per step.

    tf.recompute_grad re-runs the forward pass in backprop, which would apply BatchNorm's
    moving-statistics updates (and advance dropout's seed) twice (shared GUIDE). So the
    segment runs in a keras.StatelessScope fed with the state as explicit inputs: the
    recomputation sees the same state as the forward pass (same dropout masks) and its own
    updates are discarded; the forward pass's updates are returned and assigned once.
    """

    def __init__(self, segment: keras.Model, **kwargs):
        super().__init__(**kwargs)
        self.segment = segment

    def call(self, x, training=None):
        if not training:
            return self.segment(x, training=False)
        state = list(self.segment.non_trainable_variables)

        def forward(x, *values):
            with keras.StatelessScope(state_mapping=list(zip(state, values, strict=True))) as s:
                y = self.segment(x, training=True)
            updated = [s.get_current_value(v) for v in state]
            return (y, *[v if u is None else u for u, v in zip(updated, values, strict=True)])

        y, *new_values = tf.recompute_grad(forward)(x, *[v.value for v in state])
        for variable, value in zip(state, new_values, strict=True):
            variable.assign(value)
        return y


def block_of(name: str) -> str | None:
    match = _BLOCK.match(name)
    return match.group(1) if match else None


def _auto_named(layer) -> bool:
    """Keras's generated names (re_lu_3, activation_1, add): such layers carry no block name
    of their own, so they belong to the block they sit in. Same rule as keras to_snake_case."""
    cls = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", type(layer).__name__)
    cls = re.sub("([a-z])([A-Z])", r"\1_\2", cls).lower()
    return re.sub(r"_\d+$", "", layer.name) == cls


def block_boundaries(model: keras.Model) -> list:
    """Tensors where one block ends and the next begins and nothing else crosses.

    Walks the layers in graph order; after layer i, the tensors still to be consumed are the
    outputs of layers <= i read by layers > i. A boundary is a point where that is a single
    tensor and the block (by layer name; unnamed layers belong to the block before them)
    changes. The first boundary is a block's input, the last a block's output.
    """
    # operations, not layers: functional graphs also hold ops such as the embeddings sum.
    layers = [op for op in model.operations if not isinstance(op, keras.layers.InputLayer)]
    owners, current = [], None
    for layer in layers:
        current = block_of(layer.name) or (current if _auto_named(layer) else None)
        owners.append(current)
    produced_by = {id(layer.output): i for i, layer in enumerate(layers)}
    last_use = {}
    for j, layer in enumerate(layers):
        for node in layer._inbound_nodes:
            for tensor in node.input_tensors:
                if id(tensor) in produced_by:
                    last_use[id(tensor)] = j
    cuts = []
    for i in range(len(layers) - 1):
        live = [t for t, j in last_use.items() if j > i and produced_by[t] <= i]
        if (
            live == [id(layers[i].output)]
            and owners[i] != owners[i + 1]
            and (owners[i] or owners[i + 1])
        ):
            cuts.append(layers[i].output)
    return cuts


def segment_length(policy: str, n_blocks: int, every: int) -> int:
    if policy == "blocks":
        return 1
    if policy == "sqrt":
        return max(1, math.ceil(math.sqrt(n_blocks)))
    return every


def apply(model: keras.Model, policy: str, every: int) -> tuple[keras.Model, RematInfo]:
    """The model with its blocks grouped into rematerialised segments, and what was done."""
    if policy == "none":
        return model, RematInfo()
    cuts = block_boundaries(model)
    if len(cuts) < 2:
        raise ValueError(
            f"checkpointing={policy}: model {model.name} has no single-tensor block boundaries "
            "to cut at; use checkpointing=none"
        )
    k = segment_length(policy, len(cuts) - 1, every)
    edges = cuts[::k] if (len(cuts) - 1) % k == 0 else [*cuts[::k], cuts[-1]]
    (first,) = model.inputs  # every tfmemlab model has one input
    inputs = keras.Input(batch_shape=first.shape, dtype=first.dtype, name=first.name)
    x = keras.Model(first, edges[0], name="before_blocks")(inputs)
    info = RematInfo(policy, len(cuts) - 1, k)
    for i, (start, end) in enumerate(zip(edges, edges[1:], strict=False)):
        segment = keras.Model(start, end, name=f"segment_{i}")
        info.segment_ops.append({op.name for op in segment.operations})
        info.segment_outputs.append(segment.operations[-1].name)
        x = Remat(segment, name=f"remat_{i}")(x)
    outputs = keras.Model(edges[-1], model.outputs, name="after_blocks")(x)
    return keras.Model(inputs, outputs, name=model.name), info
