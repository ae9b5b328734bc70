"""Where checkpointing may cut a Keras model's graph: the block boundaries its segments run
between (runner/techniques/checkpointing.py rematerialises the segments).

A boundary is a single-tensor cut point: after node i in graph order, the only tensor that was
produced at or before i and is still to be read after i (model outputs count as read at the
end). Every path from the inputs to the outputs crosses such a tensor, so a sub-model from one
cut to the next holds everything in between and nothing outside, and no cut ever falls inside
a live skip connection (ResNet's shortcut, U-Net's concatenated encoder features): while a
skip is live, two tensors are.

Blocks, among the cut points:
- by layer name, when the names give them (the shipped transformer's block_0, MobileNet's
  block_3_expand/expanded_conv, EfficientNet's block2a_): the cut points where the block
  changes (`named_boundaries`);
- otherwise by structure (`structural_boundaries`): the span between two consecutive cut
  points is a block when it holds a compute layer (a layer with trainable weights other than
  a normalization: Conv, Dense, MultiHeadAttention, ...). A span of cheap layers only (norm,
  activation, pooling, padding) joins the block before it, so a block ends after its
  activation and pooling, as keras.applications' named blocks end (ResNet's convN_blockM_out,
  MobileNet's block_N_add) and the smaller pooled tensor is the one kept; cheap spans before the
  first compute layer join the first block. A chain Conv-BN-ReLU-Conv-BN-ReLU is then one block
  per convolution; a ResNet one per residual block, plus its stem and head.

Sequential models are read through the functional graph Keras 3 builds for them once their
input is known (`_functional`); subclassed models have no graph to read.
"""

import re

import keras

from runner.core.errors import ModelError

# Block names in keras.applications and models/transformer.py: block_3_expand (MobileNetV2),
# expanded_conv_2_add (MobileNetV3, V2's first block), block2a_dwconv (EfficientNet), block_0.
_BLOCK = re.compile(r"^(block_?\d+[a-z]?|expanded_conv(?:_\d+)?)(?:_|$)")
_NORMS = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
)


def graph_of(model: keras.Model, policy: str):
    """The functional graph of `model` (a Sequential's own), or a one-line ModelError."""
    if isinstance(model, keras.Sequential):
        graph = getattr(model, "_functional", None)
        if graph is None:
            raise ModelError(
                f"checkpointing={policy}: Sequential model {model.name} has no graph yet; "
                "give it a keras.Input first"
            )
        return graph
    if not hasattr(model, "_nodes_by_depth"):  # keras.src.ops.function.Function's graph
        raise ModelError(
            f"checkpointing={policy}: model {model.name} is a subclassed keras.Model, whose "
            "call() is Python code with no graph to cut or search, so no policy (blocks, sqrt, "
            "every, selective) works on it; use checkpointing=none or build it with the "
            "functional API"
        )
    return model


def _nodes(graph) -> list:
    """The graph's call nodes in an order that runs it (deepest first, as Keras runs it)."""
    by_depth = graph._nodes_by_depth
    return [n for d in sorted(by_depth, reverse=True) for n in by_depth[d] if not n.is_input]


def cut_points(graph) -> list:
    """The single-tensor cut points (module docstring), in graph order: the graph's input
    first when it has one input, its output last when it has one output."""
    nodes = _nodes(graph)
    tensors = {id(t): t for t in graph.inputs}
    produced = {id(t): -1 for t in graph.inputs}
    last_read = {}
    for i, node in enumerate(nodes):
        for t in node.outputs:
            tensors[id(t)], produced[id(t)] = t, i
        for t in node.input_tensors:
            last_read[id(t)] = i
    for t in graph.outputs:
        last_read[id(t)] = len(nodes)
    born, dead = {}, {}
    for t, i in produced.items():
        if last_read.get(t, -2) > i:  # read after it is made: live from i to its last read
            born.setdefault(i, []).append(t)
            dead.setdefault(last_read[t], []).append(t)
    live, cuts = set(), []
    for i in range(-1, len(nodes)):
        live.update(born.get(i, ()))
        live.difference_update(dead.get(i, ()))
        if len(live) == 1 and (t := next(iter(live))) not in [id(c) for c in cuts[-1:]]:
            cuts.append(tensors[t])
    return cuts


def is_compute(operation) -> bool:
    """A layer worth a block of its own: trainable weights, not a normalization's."""
    return bool(getattr(operation, "trainable_weights", None)) and not isinstance(operation, _NORMS)


def structural_boundaries(graph) -> list:
    """Block boundaries without names (module docstring): the cut points that end a block, after
    the first block's input."""
    cuts = cut_points(graph)
    if not cuts:
        return []
    position = {id(t): -1 for t in graph.inputs}
    for i, node in enumerate(_nodes(graph)):
        for t in node.outputs:
            position[id(t)] = i
    nodes = _nodes(graph)
    ends = []
    for start, end in zip(cuts, cuts[1:], strict=False):
        span = nodes[position[id(start)] + 1 : position[id(end)] + 1]
        if any(is_compute(node.operation) for node in span):
            ends.append(end)
        elif ends:  # cheap layers only: they join the block before
            ends[-1] = end
    # a span of cheap layers before the first compute layer joins the first block
    return [cuts[0], *ends] if ends else []


def block_of(name: str) -> str | None:
    match = _BLOCK.match(name)
    return match.group(1) if match else None


def _auto_named(layer) -> bool:
    """Keras's generated names (re_lu_3, activation_1, add): such layers carry no block name
    of their own, so they belong to the block they sit in. Same rule as keras to_snake_case."""
    cls = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", type(layer).__name__)
    cls = re.sub("([a-z])([A-Z])", r"\1_\2", cls).lower()
    return re.sub(r"_\d+$", "", layer.name) == cls


def named_boundaries(model: keras.Model) -> list:
    """Tensors where one named block ends and the next begins and nothing else crosses.

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


def block_boundaries(graph) -> tuple[list, str]:
    """(the block boundaries, "names" or "structure"): by names when they give a block."""
    named = named_boundaries(graph)
    if len(named) >= 2:
        return named, "names"
    return structural_boundaries(graph), "structure"
