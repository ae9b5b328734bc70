"""A functional model as the backward walk (runner/estimate/graph_walk.py) reads it: the
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
from runner.estimate import layer_rules


def _calls(graph) -> list:
    """A graph's calls of its operations (its nodes) in the order TensorFlow runs them: by
    depth from the inputs, a shared layer once for each call (graph.operations lists it once,
    at its first), a node of a layer called outside the graph left out."""
    position = {id(op): k for k, op in enumerate(graph.operations)}
    rows = [(depth, node) for depth, row in graph._nodes_by_depth.items() for node in row]
    rows.sort(key=lambda row: (-row[0], position[id(row[1].operation)]))
    return [node for _, node in rows if not node.is_input]


def calls(model) -> tuple[list, list]:
    """(each call TensorFlow runs of a layer of `model`, in order, as (node, layer, input tensor
    names, output tensor names); the names of the model's outputs). A layer called twice (shared
    weights, a siamese pair) is two calls; a nested functional model (a backbone called on the
    model's input) is its own calls in its place at each call, its inputs and outputs the
    tensors of that call. A name is (scope, id of the Keras tensor), a scope per call of a
    graph."""
    found, scopes = [], itertools.count()

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
            found.append((node, op, ins, [name(t) for t in outs]))
        return [name(t) for t in keras.tree.flatten(graph.outputs)]

    outputs = visit(model, {})
    return found, outputs


def operations(model):
    """(ops, consumers of each tensor, elements per example of each tensor) in the order they
    run (calls); an op is (index, layer, input tensor names, output tensor names), a layer with
    its own activation two (the layer, then an Activation layer on what it computed)."""
    ops, consumers, elements, made = [], {}, {}, {}

    def add(op, ins: list, outs: list) -> None:
        for t in ins:
            consumers.setdefault(t, []).append(len(ops))
        ops.append((len(ops), op, ins, outs))

    for node, op, ins, outs in calls(model)[0]:
        tensors = [*node.arguments.keras_tensors, *keras.tree.flatten(node.outputs)]
        for t, key in zip(tensors, [*ins, *outs], strict=True):
            elements[key] = math.prod(t.shape[1:])
        activation = _activation(op, made)
        if activation is not None:  # the layer, then its activation on what it computed
            computed = ("computed", outs[0])
            elements[computed] = elements[outs[0]]
            add(op, ins, [computed])
            op, ins = activation, [computed]
        add(op, ins, outs)
    return ops, consumers, elements


def own_activation(op) -> str:
    """The rules' name of the own activation of a layer with a kernel (a convolution's, a Dense
    layer's), Activation:<function> as layer_rules.kind names an Activation layer's; "" for a layer
    without one (linear)."""
    function = getattr(op, "activation", None)
    if function is None or not layer_rules.kernels(op):
        return ""
    name = getattr(function, "__name__", "unknown")
    return "" if name == "linear" else f"Activation:{name}"


def _activation(op, made: dict):
    """An Activation layer standing for a layer's own activation (own_activation), which it
    applies to the output it computed: its gradient keeps what the Activation layer's does (a
    ReLU's output, swish's input). None for a layer without one, made once for each layer."""
    if not own_activation(op):
        return None
    if id(op) not in made:
        made[id(op)] = keras.layers.Activation(op.activation, dtype=op.dtype_policy, name=op.name)
    return made[id(op)]
