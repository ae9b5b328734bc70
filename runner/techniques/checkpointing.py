"""Gradient checkpointing: recompute activations in the backward pass instead of keeping them.

Keras's RematScope fails on the TensorFlow backend (keras-team/keras#21207), so tfmemlab cuts
the functional graph at single-tensor boundaries between blocks (every transformer block,
MobileNet inverted residual, EfficientNet MBConv block by name; on other models, blocks found
from the graph's structure: runner/techniques/graph_cuts.py), makes each run of k blocks a
sub-model sharing the original layers, and wraps it in `Remat`, which calls it through
`tf.recompute_grad`. Policies: `blocks` (k = 1), `sqrt` (k = ceil(sqrt(n)), Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost"), `every` (k = checkpointing.every).

`selective` recomputes only cheap, memory-bound layers and keeps the outputs of the matmuls
and convolutions: the transformer's attention core (scores, softmax, dropout, product with V;
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"),
and on a CNN each run of normalization, activation and depthwise convolution between two
convolutions, in the spirit of in-place activated BatchNorm (Rota Bulo et al. 2018): each run
keeps only its input and output for backward (see _cheap_chains for why not pairs alone).
Both go through tf.recompute_grad, whose data dependency on the upstream gradient survives
XLA on a CPU (an optimization_barrier does not: XLA:CPU's cse_barrier_expander pass removes it
and the scheduler then hoists the recompute into the forward pass).
"""

import math
from dataclasses import dataclass, field

import keras
import tensorflow as tf

from runner.core.errors import ModelError
from runner.techniques import graph_cuts


@dataclass
class RematInfo:
    """What was rematerialised, for the figures: segments of `length` blocks each."""

    policy: str = "none"
    blocks: int = 0
    length: int = 0
    # per segment: the names of the graph operations it recomputes, and its output's producer
    segment_ops: list[set[str]] = field(default_factory=list)
    segment_outputs: list[str] = field(default_factory=list)
    # selective on a CNN: each segment's input (a convolution's output), kept for backward
    segment_inputs: list[str] = field(default_factory=list)

    @property
    def segments(self) -> int:
        return len(self.segment_ops)


class Remat(keras.layers.Layer):
    """Runs `segment` under tf.recompute_grad, updating its state once per step.

    tf.recompute_grad re-runs the forward pass in backprop, which would apply BatchNorm's
    moving-statistics updates (and advance dropout's seed) twice: measured, one step at
    momentum 0.5 moved moving_mean to 0.0627 without it and 0.0941 with it. So the segment
    runs in a keras.StatelessScope fed with the state as explicit inputs: the recomputation
    sees the same state as the forward pass (same dropout masks) and its own updates are
    discarded; the forward pass's updates are returned and assigned once.
    """

    def __init__(self, segment: keras.Model, **kwargs):
        super().__init__(**kwargs)
        self.segment = segment

    def call(self, x, training=None):
        if not training:
            return self.segment(x, training=False)
        state = list(self.segment.non_trainable_variables)
        values = [tf.identity(v.value) for v in state]  # read now: assign() follows below
        # Float state goes in as arguments; integer state (dropout seeds) is captured:
        # recompute_grad watches its arguments, and warns on every integer one.
        floats = [i for i, v in enumerate(values) if v.dtype.is_floating]

        def forward(x, *float_values):
            current = list(values)
            for i, value in zip(floats, float_values, strict=True):
                current[i] = value
            with keras.StatelessScope(state_mapping=list(zip(state, current, strict=True))) as s:
                y = self.segment(x, training=True)
            updated = [s.get_current_value(v) for v in state]
            return (y, *[v if u is None else u for u, v in zip(updated, current, strict=True)])

        y, *new_values = tf.recompute_grad(forward)(x, *[values[i] for i in floats])
        for variable, value in zip(state, new_values, strict=True):
            variable.assign(value)
        return y


def saves_nothing(info: RematInfo) -> str | None:
    """Why a policy can save little memory on this model, or None: a single segment holding
    every block rebuilds all their activations at once in backprop, so the peak stays or
    falls little, and the extra forward pass is paid (one measured exception: a 1-layer
    transformer drawn at random, without XLA, 33.5 MiB under `blocks` against 47.0 under
    `none`). The run says so before it trains (issue 15)."""
    if info.policy in ("none", "selective") or info.segments != 1:
        return None
    return (
        f"checkpointing={info.policy} saves little memory here: the model's {info.blocks} "
        f"block(s) form one segment, rebuilt whole in backprop; it costs a forward pass more. "
        "Use checkpointing=none or selective, or a model with more layers"
    )


def segment_length(policy: str, n_blocks: int, every: int) -> int:
    if policy == "blocks":
        return 1
    if policy == "sqrt":
        return max(1, math.ceil(math.sqrt(n_blocks)))
    return every


def apply(model: keras.Model, policy: str, every: int) -> tuple[keras.Model, RematInfo]:
    """The model with its blocks grouped into rematerialised segments, and what was done.
    Blocks come from layer names when they give any, else from the graph's structure
    (runner/techniques/graph_cuts.py); a subclassed model is refused in one line."""
    if policy == "none":
        return model, RematInfo()
    graph = graph_cuts.graph_of(model, policy)
    if policy == "selective":
        return selective(graph, model.name)
    cuts, _ = graph_cuts.block_boundaries(graph)
    if len(cuts) < 2:
        raise ModelError(
            f"checkpointing={policy}: model {model.name} has no single-tensor block boundaries "
            "to cut at (a model of one's own: name each block's layers block_<n>_..., "
            "docs/models.md); use checkpointing=none"
        )
    k = segment_length(policy, len(cuts) - 1, every)
    edges = cuts[::k] if (len(cuts) - 1) % k == 0 else [*cuts[::k], cuts[-1]]
    # Several inputs: the part before the first cut (where they have merged) runs plainly.
    inputs = [keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name) for t in graph.inputs]
    if len(inputs) == 1:
        (originals,), inputs = graph.inputs, inputs[0]
    else:
        originals = graph.inputs
    x = inputs
    if not any(edges[0] is t for t in graph.inputs):
        x = keras.Model(originals, edges[0], name="before_blocks")(inputs)
    info = RematInfo(policy, len(cuts) - 1, k)
    for i, (start, end) in enumerate(zip(edges, edges[1:], strict=False)):
        segment = keras.Model(start, end, name=f"segment_{i}")
        info.segment_ops.append({op.name for op in segment.operations})
        info.segment_outputs.append(segment.operations[-1].name)
        x = Remat(segment, name=f"remat_{i}")(x)
    outputs = x
    if not (len(graph.outputs) == 1 and edges[-1] is graph.outputs[0]):
        outputs = keras.Model(edges[-1], graph.outputs, name="after_blocks")(x)
    return keras.Model(inputs, outputs, name=model.name), info


# Cheap, memory-bound layers a selective segment may hold (issue 14 measured them memory-bound).
_CHEAP = (
    keras.layers.BatchNormalization,
    keras.layers.ReLU,
    keras.layers.Activation,
    keras.layers.DepthwiseConv2D,
    keras.layers.ZeroPadding2D,
)


def _cheap_chains(model: keras.Model) -> list[list]:
    """Runs of cheap layers from one convolution's output to the next one's input, each
    layer's output read only by the next: normalization+activation, a depthwise convolution,
    normalization+activation (MobileNet's and EfficientNet's blocks). Only runs with a
    depthwise convolution inside save memory: TensorFlow's BatchNorm gradient keeps only its
    input, so a norm+activation pair alone keeps its input and output with or without
    recomputation; dropping the depthwise convolution's input and output is the saving."""
    readers = {}
    for op in model.operations:
        for node in op._inbound_nodes:
            for tensor in node.input_tensors:
                readers.setdefault(id(tensor), []).append(op)

    def next_cheap(op):
        following = readers.get(id(op.output), [])
        return following[0] if len(following) == 1 and isinstance(following[0], _CHEAP) else None

    followers = {
        id(n) for op in model.operations if isinstance(op, _CHEAP) and (n := next_cheap(op))
    }
    chains = []
    for op in model.operations:
        if not isinstance(op, _CHEAP) or id(op) in followers:
            continue
        chain = [op]
        while (following := next_cheap(chain[-1])) is not None:
            chain.append(following)
        if any(isinstance(c, keras.layers.DepthwiseConv2D) for c in chain[1:]):
            chains.append(chain)
    return chains


def selective(model: keras.Model, name: str = "") -> tuple[keras.Model, RematInfo]:
    """checkpointing=selective: the transformer's attention core, or a CNN's runs of cheap
    layers between convolutions, recomputed in backprop (module docstring)."""
    blocks = [layer for layer in model.layers if hasattr(layer, "recompute_attention")]
    if blocks:
        for block in blocks:
            block.recompute_attention = True
        names = [{f"{block.name}/attention_core"} for block in blocks]
        return model, RematInfo("selective", len(blocks), 1, names, [b.name for b in blocks])
    chains = _cheap_chains(model)
    if not chains:
        raise ModelError(
            f"checkpointing=selective: model {name or model.name} has neither attention blocks nor "
            "depthwise convolutions between normalizations to recompute; use checkpointing=none"
        )
    info = RematInfo("selective", len(chains), 1)
    lasts = {}
    for i, chain in enumerate(chains):
        segment = keras.Model(chain[0].input, chain[-1].output, name=f"cheap_{i}")
        lasts[id(chain[-1])] = Remat(segment, name=f"remat_cheap_{i}")
        info.segment_ops.append({op.name for op in chain})
        info.segment_outputs.append(chain[-1].name)
        info.segment_inputs.append(chain[0]._inbound_nodes[0].parent_nodes[0].operation.name)
    inside = {id(op) for chain in chains for op in chain} - set(lasts)

    def call(layer, *args, **kwargs):
        if id(layer) in lasts:  # the chain's Remat runs it all, from the chain's input
            return lasts[id(layer)](args[0])
        if id(layer) in inside:  # pass the chain's input along to its last layer
            return args[0]
        return layer(*args, **kwargs)

    rebuilt = keras.models.clone_model(
        model, clone_function=lambda layer: layer, call_function=call
    )
    return rebuilt, info
