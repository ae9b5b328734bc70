"""Exact attention in memory linear in the sequence length (issue 29): the attention core
computed one block of keys at a time, for model.attention=chunked.

Keras 3's `dot_product_attention` refuses flash attention on the TensorFlow backend, so the
standard core (models/memory_limited.attention_core) holds a*s^2*b scores, probabilities and
their gradients per layer. Here the softmax runs online over key blocks, with a running max
and sum per query in float32 (Rabe & Staats 2021, "Self-attention does not need O(n^2)
memory"; Dao et al. 2022, FlashAttention), and the backward pass is FlashAttention-2's
(Dao 2023, Algorithm 2): it keeps only q, k, v, the output and the per-query logsumexp L, and
recomputes each block's probabilities from L. Every temporary is [B, N, T, block]: for a
fixed block, linear in the sequence length.

One tf.custom_gradient wraps the whole core, so TensorFlow never differentiates through the
loops (it would keep every iteration's blocks). The loops run one iteration at a time
(parallel_iterations=1): the executor would otherwise run the key blocks' independent work
side by side and hold several blocks' temporaries at once. For the same reason the backward
pass's work waits for the output gradient, and a dropout factor for its block's scores
(control dependencies): without XLA, TensorFlow's executor runs a loop's operations as soon as
their own inputs exist, so every layer's backward computed its blocked copies and its first
key block's probabilities and dropout factors when the backward pass began (and every forward
loop its first factors when the step began), and held them until its turn came. Measured, a
chain of 4 cores (124 tokens, 14 heads, one key block, no XLA): 1.0 a*s*block*b float32 more a
layer without dropout, 3.3 with it; with them none, and 0.2 with dropout
(tests/test_chunked_attention.py).

Dropout draws its mask block by block from (seed, block index) with a stateless RNG, and
backward draws the same masks again: no mask of the scores' size is stored. These masks are
not those of memory_limited.probs_dropout (one draw over all s^2 scores), so with dropout the
chunked core equals a dense reference that applies `block_dropout_scale`'s masks, and at
rate 0 it equals the standard core (tests/test_chunked_attention.py checks both).
"""

import math

import tensorflow as tf

_MASKED = tf.float32.min  # as memory_limited.softmax: exp() of it, less the max, is 0
_ALG = "philox"  # the same stream with and without XLA ("auto_select" may pick differently)
_F32 = tf.float32


def block_dropout_scale(seed, index, shape, rate: float):
    """Dropout factors of key block `index`, float32 of `shape` ([B, N, T, block]): 0 where
    dropped, 1 / (1 - rate) where kept. A function of (seed, index, position) only, so
    backward regenerates exactly the forward pass's mask."""
    block_seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(index, tf.int32), _ALG)
    uniform = tf.random.stateless_uniform(shape, block_seed, alg=_ALG)
    return tf.cast(uniform >= rate, _F32) / (1.0 - rate)


def _blocks(x, block: int, count):
    """[B, S, N, H] -> [count, B, N, block, H], zero-padded after the last key."""
    x = tf.pad(x, [[0, 0], [0, count * block - tf.shape(x)[1]], [0, 0], [0, 0]])
    batch, heads, width = tf.shape(x)[0], x.shape[2], x.shape[3]
    return tf.transpose(tf.reshape(x, [batch, count, block, heads, width]), [1, 0, 3, 2, 4])


def _unblock(x, length):
    """[count, B, N, block, H] -> [B, length, N, H]: _blocks undone, the padding dropped."""
    count, batch, heads, block, width = tf.unstack(tf.shape(x))
    x = tf.reshape(tf.transpose(x, [1, 0, 3, 2, 4]), [batch, count * block, heads, width])
    return x[:, :length]


class _Blocks:
    """The core's operands in the loops' layouts, and the masked scores of one key block."""

    def __init__(self, query, key, value, causal: bool, block: int):
        self.length = key.shape[1] if key.shape[1] is not None else tf.shape(key)[1]
        if isinstance(self.length, int):
            block = min(block, self.length)  # one short block, not one padded to `block`
        self.block, self.causal = block, causal
        self.count = (self.length + block - 1) // block
        self.scale = 1.0 / math.sqrt(query.shape[-1])
        # Scaled in the compute dtype before the product, as memory_limited.attention_scores.
        self.q = tf.transpose(query * tf.cast(self.scale, query.dtype), [0, 2, 1, 3])
        self.k, self.v = _blocks(key, block, self.count), _blocks(value, block, self.count)
        self.rows = tf.shape(self.q)[:3]  # [B, N, T]

    def scores(self, j):
        """Float32 scores [B, N, T, block] of key block j, padding (and the future) masked."""
        scores = tf.cast(tf.einsum("BNTH,BNKH->BNTK", self.q, self.k[j]), _F32)
        keys = j * self.block + tf.range(self.block)
        allowed = keys[None, :] < self.length
        if self.causal:  # query t sees keys 0..t, as band_part(-1, 0) in the standard core
            allowed &= keys[None, :] <= tf.range(self.rows[2])[:, None]
        return tf.where(allowed, scores, _MASKED)

    def loop(self, body, state):
        """tf.while_loop over the key blocks, one at a time; body(j, *state) -> state."""
        _, *state = tf.while_loop(
            lambda j, *_: j < self.count,
            lambda j, *s: (j + 1, *body(j, *s)),
            (tf.constant(0), *state),
            parallel_iterations=1,
        )
        return state


def _forward(b: _Blocks, seed, rate: float):
    """Output [B, N, T, H] in float32 and the logsumexp L [B, N, T] of each query's scores."""

    def body(j, top, total, acc):
        scores = b.scores(j)
        new_top = tf.maximum(top, tf.reduce_max(scores, -1))
        probs = tf.exp(scores - new_top[..., None])
        rescale = tf.exp(top - new_top)  # what the old max's terms are worth under the new one
        total = total * rescale + tf.reduce_sum(probs, -1)  # the normaliser: before dropout
        if rate > 0:
            with tf.control_dependencies([probs]):  # drawn when the block is, not before
                probs *= block_dropout_scale(seed, j, tf.shape(probs), rate)
        step = tf.einsum("BNTK,BNKH->BNTH", tf.cast(probs, b.v.dtype), b.v[j])
        return new_top, total, acc * rescale[..., None] + tf.cast(step, _F32)

    state = (tf.fill(b.rows, _MASKED), tf.zeros(b.rows), tf.zeros(tf.shape(b.q), _F32))
    top, total, acc = b.loop(body, state)
    return acc / total[..., None], top + tf.math.log(total)


def _backward(b: _Blocks, output, lse, dout, seed, rate: float):
    """Gradients of query, key and value from the output's (FlashAttention-2's backward)."""
    dtype = b.q.dtype
    delta = tf.einsum("BTNH,BTNH->BNT", tf.cast(dout, _F32), tf.cast(output, _F32))
    dout = tf.transpose(dout, [0, 2, 1, 3])  # [B, N, T, H]
    element = b.k.shape[1:]

    def body(j, dq, dk, dv):
        dprobs = tf.cast(tf.einsum("BNTH,BNKH->BNTK", dout, b.v[j]), _F32)
        with tf.control_dependencies([dprobs]):  # the block waits for the output gradient
            probs = tf.exp(b.scores(j) - lse[..., None])  # P_j, from the saved logsumexp
            dropped = probs
            if rate > 0:  # the forward pass's mask, drawn again
                factor = block_dropout_scale(seed, j, tf.shape(probs), rate)
                dropped, dprobs = probs * factor, dprobs * factor
        dv = dv.write(j, tf.einsum("BNTK,BNTH->BNKH", tf.cast(dropped, dtype), dout))
        dscores = tf.cast(probs * (dprobs - delta[..., None]), dtype)
        dk = dk.write(j, tf.einsum("BNTK,BNTH->BNKH", dscores, b.q))  # q already scaled
        return dq + tf.cast(tf.einsum("BNTK,BNKH->BNTH", dscores, b.k[j]), _F32), dk, dv

    arrays = [tf.TensorArray(dtype, size=b.count, element_shape=element) for _ in "kv"]
    dq, dk, dv = b.loop(body, (tf.zeros(tf.shape(b.q), _F32), *arrays))
    dq = tf.transpose(tf.cast(dq * b.scale, dtype), [0, 2, 1, 3])
    return dq, _unblock(dk.stack(), b.length), _unblock(dv.stack(), b.length)


def chunked_attention_core(query, key, value, seed, rate: float, causal: bool, block: int):
    """memory_limited.attention_core's computation, exact, key block by key block.

    query [B, T, N, H], key and value [B, S, N, H] -> [B, T, N, H] in query's dtype. seed: an
    int32 pair (stateless dropout), None at rate 0; causal: query t sees keys 0..t; block: keys
    per block (a sequence shorter than it is one block). Backward keeps q, k, v, the output and
    a float32 logsumexp per query, and recomputes every block of probabilities from them.
    """

    @tf.custom_gradient
    def core(query, key, value):
        output, lse = _forward(_Blocks(query, key, value, causal, block), seed, rate)
        output = tf.cast(tf.transpose(output, [0, 2, 1, 3]), query.dtype)

        def backward(dout):
            # The blocked layouts are rebuilt here (copies of k and v, O(s)), not kept, once
            # the output gradient exists (see the module's docstring on the executor).
            with tf.control_dependencies([dout]):
                blocks = _Blocks(query, key, value, causal, block)
            return _backward(blocks, output, lse, dout, seed, rate)

        return output, backward

    return core(query, key, value)
