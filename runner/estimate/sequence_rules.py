"""The rules of the layers that step or attend along a sequence, as runner/estimate/layer_rules.py
gives every layer kind's: the recurrent layers (LSTM, GRU, SimpleRNN, a Bidirectional of one)
and keras's MultiHeadAttention, what their backward keeps and holds. Measured the way the other
rules are: chains of the layer, the allocator's peak of a forward and backward."""

import math


def attention_sizes(op, out: int) -> tuple[int, int, int]:
    """(elements of the query-side projections, of the key/value-side ones, of the score
    matrix) of a MultiHeadAttention call whose output has `out` elements (all examples)."""
    node = op._inbound_nodes[0]
    query, value = node.input_tensors[0], node.input_tensors[1]
    q_rows = out // query.shape[-1]  # batch x query positions
    t_q, t_s = math.prod(query.shape[1:-1]), math.prod(value.shape[1:-1])
    s_rows = q_rows // t_q * t_s
    heads, key_dim, value_dim = op.num_heads, op.key_dim, op.value_dim or op.key_dim
    q_side = q_rows * heads * (key_dim + value_dim)  # query, context
    kv_side = s_rows * heads * (key_dim + value_dim)  # key, value
    return q_side, kv_side, q_rows * heads * t_s


BACKWARD_SCOPE = "gradient_tape"  # the name scope of a tf.GradientTape's backward ops


def forward_keeps_scaled_softmax(model_name: str) -> bool:
    """Whether a step keeps the scaled copy of a MultiHeadAttention's float32 softmax (its
    dropout-free path): the forward and the backward each compute the product, and the step
    keeps one. Which one follows the ops' names: the forward's sit in the model's name scope,
    the backward's under BACKWARD_SCOPE, and the forward's is kept (one more score-sized
    float32 tensor a layer) when the model's name sorts first. Measured (a pre-norm ViT block
    of LayerNormalization, MultiHeadAttention and a GELU MLP, 64 tokens, 2 heads of 8, b 22,
    two layers more): the same model named "functional" or "gradient_tapa" 2.95-2.97 MiB a
    layer, named "vit", "zz" or "gradient_tapz" 2.19-2.30; the score tensor is 0.69 MiB."""
    return model_name < BACKWARD_SCOPE


# Recurrent layers. On a CPU, keras's LSTM and GRU fall back from cuDNN (which needs a GPU:
# keras/src/backend/tensorflow/rnn.py lstm/gru raise NotImplementedError) to backend.rnn, a
# tf.while_loop over the time steps (parallel_iterations=32). In a tf.function that is
# while_v2, whose forward pushes every tensor the gradient reads onto a list at each step
# (tensorflow/python/ops/while_v2.py _capture_helper). Per step it keeps RECURRENT_KEPT (b, U)
# tensors: an LSTM's four gates, c_{t-1}, tanh(c_t) and h_{t-1}; a GRU's z, r, hh, 1 - z, its
# recurrent_h slice and h_{t-1}; a SimpleRNN's h_{t-1} (the previous step's tanh, one buffer);
# beside them the step's x_t (b, F), and, where the layer's input gets a gradient, one more
# (b, F) list (while_v2's zeros for the input gradient, made as the forward loop ends). Under
# a 16-bit policy the kernels are cast inside the loop body, so each step keeps their 16-bit
# casts too: (F + U) x G*U. return_sequences changes none of it (the outputs are the h_t it
# keeps); Bidirectional is two of them. Measured (a chain of each, b 16-48, T 30-80, F 24-64,
# U 24-72, float32, float16, bfloat16): 0.93-1.05 of the rule in requested bytes.
RECURRENT_KEPT = {"LSTM": 7, "GRU": 6, "SimpleRNN": 1}
GATES = {"LSTM": 4, "GRU": 3, "SimpleRNN": 1}
RNN_PARALLEL_ITERATIONS = 32  # keras/src/backend/tensorflow/rnn.py's while_loop


def recurrent_shape(op) -> tuple | None:
    """(kind, directions, T, F, U, return_sequences) of a recurrent layer (or a Bidirectional
    of one) with a fixed number of steps; None for any other layer."""
    inner, directions = op, 1
    if type(op).__name__ == "Bidirectional":
        inner, directions = op.forward_layer, 2
    name = type(inner).__name__
    if name not in RECURRENT_KEPT or not getattr(op, "_inbound_nodes", None):
        return None
    _, steps, features = op._inbound_nodes[0].input_tensors[0].shape
    if steps is None:
        return None
    return name, directions, steps, features, inner.units, inner.return_sequences


def _recurrent_step(shape, b: int, width: int, grad_in: bool) -> tuple[int, int]:
    """(bytes a step keeps, bytes a step's weight-gradient products hold) in one direction."""
    name, _, _, features, units, _ = shape
    gates = GATES[name] * units
    cast = (features + units) * gates * width if width < 4 else 0
    kept = b * (RECURRENT_KEPT[name] * units + (2 if grad_in else 1) * features) * width + cast
    products = (features + units) * gates * (width + (4 if width < 4 else 0))
    return kept, products


def recurrent_kept_bytes(op, into: int, width: int, grad_in: bool) -> int:
    """Bytes a recurrent layer keeps for its backward (into: its input's elements, all
    examples; grad_in: its input's gradient is computed): every step's (RECURRENT_KEPT)."""
    shape = recurrent_shape(op)
    if shape is None:
        return 0
    _, directions, steps, features, _, _ = shape
    kept, _ = _recurrent_step(shape, into // (steps * features), width, grad_in)
    return directions * steps * kept


def recurrent_workspace_bytes(op, into: int, width: int) -> int:
    """Bytes a recurrent layer's backward holds beside what it keeps: its output gradient
    (with return_sequences, transposed to time-major and unstacked: alive through the loop)
    and a step's gate gradients (3 x b x G*U). The weight-gradient products the loop may run
    ahead of their sum are, as a bound (recurrent_ahead_bytes)."""
    shape = recurrent_shape(op)
    if shape is None:
        return 0
    name, directions, steps, features, units, sequences = shape
    b = into // (steps * features)
    out = b * directions * units * (steps if sequences else 1) * width
    gates = directions * 3 * b * GATES[name] * units * width
    return out + gates + recurrent_ahead_bytes(op, into, width)


def recurrent_ahead_bytes(op, into: int, width: int) -> int:
    """Bytes a recurrent layer's backward may hold beyond the rule: the weight-gradient
    products ((F + U) x G*U a step, float32 beside their 16-bit form under a 16-bit policy) of
    up to RNN_PARALLEL_ITERATIONS steps the loop runs ahead of their sum, less the kept steps
    popped meanwhile. How many is the executor's timing, and it varies between identical
    runs: an LSTM (b 8, F = U = 128, 64 steps) peaked 13.3-20.5 MiB (0 to 15 steps ahead), a
    SimpleRNN (b 16, U 256, 80 steps) 15.1-24.3 MiB; a GRU (b 32, U 200) ran none ahead in 40
    steps. The estimate takes all of them, a bound: a long run's peak, the most of its steps,
    comes closest to it, and the run's note says how much of the estimate it is."""
    shape = recurrent_shape(op)
    if shape is None:
        return 0
    _, directions, steps, features, _, _ = shape
    kept, products = _recurrent_step(shape, into // (steps * features), width, True)
    return directions * min(steps, RNN_PARALLEL_ITERATIONS) * max(0, products - kept)
