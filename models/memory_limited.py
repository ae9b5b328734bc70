"""Memory-limited layers (issue 15): each keeps for its backward pass only what that pass
needs, in the compute dtype, and recomputes the cheap rest from it.

TensorFlow's own gradients keep more than the math needs. Measured on TF 2.21 / Keras 3.15
(eager tape, bytes kept over one input's size, output included): Keras LayerNormalization
7.4x (a float32 copy of the input, the centred input, the normalised one), exact GELU 6.2x,
and at dropout 0 MultiHeadAttention's `ops.dot_product_attention` keeps the float32
probabilities beside their 16-bit copy, so 16-bit attention saved nothing
(keras/src/backend/tensorflow/nn.py dot_product_attention).
The functions below keep, for backward:
- layer_norm: its input only (mean and inverse deviation are recomputed, a few FLOPs per
  element), and computes in float32 like Keras;
- gelu: its input only;
- softmax: its output only, in the compute dtype; it computes in float32, and the causal
  mask is built inside, so no mask of the scores' size is kept;
- attention_core: the scaled queries and the keys (for the scores), the probabilities (for
  the softmax), with dropout its 1-byte mask and the dropped probabilities, and the values.
That is exactly Korthikanti et al. 2022's accounting (34sbh + 5as^2b bytes per layer at 16
bits with dropout), which runner/estimate/memory.py uses.
"""

import math

import keras
import tensorflow as tf


def after(dy, x):
    """x, read only once dy exists. A backward's terms that need x alone would otherwise be
    computed by the executor as soon as x exists, in the forward pass, and held until dy
    comes: a transformer without XLA held each GELU's float32 slope (16 bytes per element of
    its 4h-wide input) and each LayerNorm's float32 centred input (4 bytes per element) from
    its forward to its backward, 24sbh bytes a layer beyond what it keeps (a 7-layer
    transformer at s=77, b=18, h=36, one head, bfloat16: 8.2 MiB of 44.1 at its peak, read off
    the allocator's trace of a step)."""
    with tf.control_dependencies([dy]):
        return tf.identity(x)


def _moments(x):
    """float32 x, and its mean and variance over the last axis."""
    xf = tf.cast(x, tf.float32)
    mean, variance = tf.nn.moments(xf, axes=[-1], keepdims=True)
    return xf, mean, variance


def layer_norm(x, gamma, beta, epsilon: float):
    """LayerNorm over the last axis in float32, output in x's dtype; backward keeps only x."""

    @tf.custom_gradient
    def forward(x, gamma, beta):
        xf, mean, variance = _moments(x)
        y = (xf - mean) * tf.math.rsqrt(variance + epsilon) * gamma + beta

        def backward(dy):
            xf, mean, variance = _moments(after(dy, x))
            inv = tf.math.rsqrt(variance + epsilon)
            xhat = (xf - mean) * inv
            dy = tf.cast(dy, tf.float32)
            outer = tf.range(tf.rank(dy) - 1)
            g = dy * gamma
            dx = inv * (
                g
                - tf.reduce_mean(g, -1, keepdims=True)
                - xhat * tf.reduce_mean(g * xhat, -1, keepdims=True)
            )
            return (
                tf.cast(dx, x.dtype),
                tf.reduce_sum(dy * xhat, outer),
                tf.reduce_sum(dy, outer),
            )

        return tf.cast(y, x.dtype), backward

    return forward(x, tf.cast(gamma, tf.float32), tf.cast(beta, tf.float32))


@keras.saving.register_keras_serializable(package="tfmemlab")  # a saved model loads it back
class LayerNorm(keras.layers.LayerNormalization):
    """keras.layers.LayerNormalization (same variables, same config) over the last axis,
    keeping only its input for backward."""

    def call(self, inputs):
        return layer_norm(
            inputs,
            keras.ops.convert_to_tensor(self.gamma),
            keras.ops.convert_to_tensor(self.beta),
            self.epsilon,
        )


_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@tf.custom_gradient
def gelu(x):
    """Exact GELU, x * Phi(x), computed in float32 (Keras's `gelu`, approximate=False);
    backward keeps only x and recomputes Phi(x) + x * phi(x)."""
    xf = tf.cast(x, tf.float32)
    y = 0.5 * xf * (1.0 + tf.math.erf(xf * _SQRT_HALF))

    def backward(dy):
        xf = tf.cast(after(dy, x), tf.float32)
        slope = 0.5 * (1.0 + tf.math.erf(xf * _SQRT_HALF)) + xf * _INV_SQRT_2PI * tf.exp(
            -0.5 * xf * xf
        )
        return tf.cast(tf.cast(dy, tf.float32) * slope, x.dtype)

    return tf.cast(y, x.dtype), backward


def softmax(scores, causal: bool):
    """Softmax over the last axis in float32, causal-masked if asked, output in the scores'
    dtype; backward keeps only that output: dscores = p * dp - p * sum(p * dp)."""

    @tf.custom_gradient
    def forward(scores):
        logits = tf.cast(scores, tf.float32)
        if causal:
            t, s = tf.shape(logits)[-2], tf.shape(logits)[-1]
            band = tf.linalg.band_part(tf.ones((t, s), tf.bool), -1, 0)
            logits = tf.where(band, logits, tf.float32.min)
        probs = tf.cast(tf.nn.softmax(logits, axis=-1), scores.dtype)

        def backward(dprobs):
            # Elementwise in the compute dtype, the row sums in float32: float32 copies of
            # p and dp (the textbook form) made the 16-bit backward's transients larger than
            # float32's (2-layer transformer, s=256, b=8, h=32: 40.3 MiB against 23.9 here).
            pd = probs * dprobs
            total = tf.reduce_sum(tf.cast(pd, tf.float32), -1, keepdims=True)
            return pd - probs * tf.cast(total, probs.dtype)

        return probs, backward

    return forward(scores)


def attention_scores(query, key):
    """Scaled dot products [B, N, T, S] of queries [B, T, N, H] and keys [B, S, N, H]."""
    scale = tf.cast(1.0 / math.sqrt(query.shape[-1]), query.dtype)
    return tf.einsum("BTNH,BSNH->BNTS", query * scale, key)


def probs_dropout(probs, rate: float, seed):
    """Dropout on the attention probabilities with an explicit seed: the same mask when the
    core is recomputed (checkpointing=selective). tf's dropout keeps a boolean mask."""
    if rate == 0:
        return probs
    return tf.nn.experimental.stateless_dropout(probs, rate=rate, seed=seed)


def attention_context(probs, value):
    """Probabilities [B, N, T, S] applied to values [B, S, N, H]: [B, T, N, H].

    Backward computes the values' gradient first, so the (dropped) probabilities it reads are
    freed before their own gradient, the size of the scores, is allocated. Left to the
    executor, the order of the two varied from run to run, and so did the peak (by up to 20%
    on a 2-layer transformer at s=256).
    """

    @tf.custom_gradient
    def forward(probs, value):
        def backward(dcontext):
            dvalue = tf.einsum("BNTS,BTNH->BSNH", probs, dcontext)
            with tf.control_dependencies([dvalue]):
                dprobs = tf.einsum("BTNH,BSNH->BNTS", dcontext, value)
            return dprobs, dvalue

        return tf.einsum("BNTS,BSNH->BTNH", probs, value), backward

    return forward(probs, value)


def attention_core(query, key, value, seed, rate: float, causal: bool):
    """Scores, softmax, dropout and the product with V (Korthikanti et al. 2022's "core
    attention", the part checkpointing=selective recomputes)."""
    probs = softmax(attention_scores(query, key), causal)
    return attention_context(probs_dropout(probs, rate, seed), value)
