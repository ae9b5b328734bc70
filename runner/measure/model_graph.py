"""A functional model as the backward walk (runner/measure/backward.py) reads it: the
operations TensorFlow runs, in order, with the tensors each reads and writes.

Keras's graph lists each layer once; TensorFlow runs what each call of it computes. So:
- a layer called more than once (a siamese pair's backbone, a head shared by two branches) is
  an operation at each call, its nodes taken by depth (_calls);
- a functional model nested as one layer (a keras.applications backbone called on the input)
  is its own operations in its place, at each call, its tensors named per call;
- a layer's own activation (Conv2D(..., activation="relu"), Dense(..., activation="swish"))
  is an Activation layer after it (_activation): the layer computes its output, then applies
  the function, whose gradient keeps what an Activation layer's does (a ReLU's output,
  swish's input), not what the layer's kind keeps.
"""

import itertools
import math

import keras

from models.common import is_graph


def _calls(graph) -> list:
    """A graph's calls of its operations (its nodes) in the order TensorFlow runs them: by
    depth from the inputs, a shared layer once for each call (graph.operations lists it once,
    at its first), a node of a layer called outside the graph left out."""
    position = {id(op): k for k, op in enumerate(graph.operations)}
    rows = [(depth, node) for depth, row in graph._nodes_by_depth.items() for node in row]
    rows.sort(key=lambda row: (-row[0], position[id(row[1].operation)]))
    return [node for _, node in rows if not node.is_input]


def operations(model):
    """(ops, consumers of each tensor, elements per example of each tensor) in the order they
    run; an op is (index, layer, input tensor names, output tensor names), a layer called
    twice (shared weights, a siamese pair) two ops, a layer with its own activation two (the
    layer, then an Activation layer on what it computed). A nested functional model (a backbone
    called on the model's input) is its own operations in its place at each call, its inputs
    and outputs the tensors of that call: what TensorFlow runs."""
    ops, consumers, elements, made = [], {}, {}, {}
    scopes = itertools.count()

    def add(op, ins: list, outs: list) -> None:
        for t in ins:
            consumers.setdefault(t, []).append(len(ops))
        ops.append((len(ops), op, ins, outs))

    def visit(graph, bound: dict) -> list:
        """Walks one call of `graph`, whose inputs are `bound` (id -> name); its outputs' names."""
        scope = next(scopes)

        def name(t):
            return bound.get(id(t), (scope, id(t)))

        for node in _calls(graph):
            op = node.operation
            ins = [name(t) for t in node.arguments.keras_tensors]
            outs = keras.tree.flatten(node.outputs)
            if is_graph(op):
                inner = dict(zip(map(id, keras.tree.flatten(op.inputs)), ins, strict=True))
                results = visit(op, inner)
                bound.update(zip(map(id, outs), results, strict=True))
                continue
            names = [name(t) for t in outs]
            tensors = [*node.arguments.keras_tensors, *outs]
            for t, key in zip(tensors, [*ins, *names], strict=True):
                elements[key] = math.prod(t.shape[1:])
            activation = _activation(op, made)
            if activation is not None:  # the layer, then its activation on what it computed
                elements[(scope, id(node))] = elements[names[0]]
                add(op, ins, [(scope, id(node))])
                op, ins = activation, [(scope, id(node))]
            add(op, ins, names)
        return [name(t) for t in keras.tree.flatten(graph.outputs)]

    visit(model, {})
    return ops, consumers, elements


def _activation(op, made: dict):
    """An Activation layer standing for the own activation of a layer with a kernel (a
    convolution's, a Dense layer's), which it applies to the output it computed: its gradient
    keeps what the Activation layer's does (a ReLU's output, swish's input). None for a layer
    without one (linear), made once for each layer."""
    function = getattr(op, "activation", None)
    kernels = (getattr(op, k, None) for k in ("kernel", "depthwise_kernel", "pointwise_kernel"))
    if function is None or all(k is None for k in kernels):
        return None
    if getattr(function, "__name__", "") == "linear":
        return None
    if id(op) not in made:
        made[id(op)] = keras.layers.Activation(function, dtype=op.dtype_policy, name=op.name)
    return made[id(op)]
