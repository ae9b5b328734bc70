"""Memory-limited layers (issue 15): the custom gradients are the true gradients, and the
transformer block built from them computes what Keras's own layers compute."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from models import memory_limited as ml
from models.transformer import TransformerBlock
from tests.conftest import ONE_THREAD, fresh_result


def _band(t: int, s: int):
    return tf.linalg.band_part(tf.ones((t, s), tf.bool), -1, 0)


def _reference_layer_norm(x, gamma, beta):
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + 1e-5) * gamma + beta


def _reference_softmax(scores):
    return tf.nn.softmax(tf.where(_band(*scores.shape[-2:]), scores, -1e30), axis=-1)


CASES = {
    "layer_norm": (lambda x, g, b: ml.layer_norm(x, g, b, 1e-5), _reference_layer_norm, 3),
    "gelu": (ml.gelu, lambda x: keras.activations.gelu(x, approximate=False), 1),
    "softmax": (lambda s: ml.softmax(s, causal=True), _reference_softmax, 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_custom_gradients_are_the_autodiff_gradients(name):
    fn, reference, n_args = CASES[name]
    rng = np.random.default_rng(0)
    # Asymmetric shapes (rows != features), values well away from zero so a dropped term shows.
    shapes = [(3, 2, 5, 7), (7,), (7,)][:n_args]
    args = [tf.constant(rng.normal(size=s) * 2.0, tf.float32) for s in shapes]
    upstream = tf.constant(rng.normal(size=shapes[0]), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(args)
        got, expected = fn(*args), reference(*args)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(
        tape.gradient(got, args, upstream), tape.gradient(expected, args, upstream), strict=True
    ):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_attention_context_gradients_are_autodiffs_and_free_the_probabilities_first():
    rng = np.random.default_rng(0)
    probs = tf.constant(rng.uniform(size=(2, 3, 5, 7)), tf.float32)  # [B, N, T, S]
    value = tf.constant(rng.normal(size=(2, 7, 3, 4)), tf.float32)  # [B, S, N, H]
    upstream = tf.constant(rng.normal(size=(2, 5, 3, 4)), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([probs, value])
        got = ml.attention_context(probs, value)
        expected = tf.einsum("BNTS,BSNH->BTNH", probs, value)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    for g, e in zip(
        tape.gradient(got, [probs, value], upstream),
        tape.gradient(expected, [probs, value], upstream),
        strict=True,
    ):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)

    # The values' gradient (the last reader of the probabilities) runs before the
    # probabilities' gradient is allocated: a control edge, not the executor's choice.
    @tf.function
    def backward(probs, value, upstream):
        with tf.GradientTape() as tape:
            tape.watch([probs, value])
            out = ml.attention_context(probs, value)
        return tape.gradient(out, [probs, value], upstream)

    graph = backward.get_concrete_function(probs, value, upstream).graph
    dprobs, dvalue = (t.op for t in graph.outputs)
    while dprobs.type in ("Identity", "IdentityN"):  # past the function's output wrappers
        dprobs = dprobs.inputs[0].op
    while dvalue.type in ("Identity", "IdentityN"):
        dvalue = dvalue.inputs[0].op
    assert dvalue in dprobs.control_inputs, (dprobs.type, [op.name for op in dprobs.control_inputs])


def _keras_block_output(block, x):
    """The block's computation in Keras's own layers (LayerNormalization, MultiHeadAttention
    at dropout 0, Dense with Keras's GELU), on the block's weights."""

    def norm(layer, t):
        return keras.ops.layer_normalization(t, layer.gamma, layer.beta, epsilon=1e-5)

    y = norm(block.attn_norm, x)
    x = x + block.attn(y, y, use_causal_mask=block.causal)
    up = block.mlp_up
    hidden = keras.activations.gelu(norm(block.mlp_norm, x) @ up.kernel + up.bias, False)
    return x + block.mlp_down(hidden)


@pytest.mark.parametrize("causal", [True, False])
def test_block_gradients_match_keras_layers(causal):
    keras.utils.set_random_seed(0)
    block = TransformerBlock(24, 3, 0.0, causal=causal)
    x = tf.random.normal((2, 10, 24))
    upstream = tf.random.normal((2, 10, 24))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        got, expected = block(x, training=True), _keras_block_output(block, x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    wrt = [x, *block.trainable_variables]
    for g, e in zip(
        tape.gradient(got, wrt, upstream), tape.gradient(expected, wrt, upstream), strict=True
    ):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


# The estimate against the allocator's measured peak, transformer without XLA, at sizes where
# s != h and as/h != 1 (s=256, h=32, 4 heads: as/h = 32, attention-bound): every precision,
# dropout and policy. Each job in a fresh process (runner.bench), one at a time.
@pytest.mark.slow  # 4 fresh processes: about 60 s of CPU
def test_estimate_tracks_the_measured_peak_for_every_precision_dropout_and_policy(capsys):
    """Issue 15's band over four cells of the calibration matrix that hold every value of
    precision, dropout and policy; `python -m runner.bench estimate` runs all 18 cells, and
    tests/test_estimate_draws.py draws combinations at random. Over four runs of the full
    matrix, alone, the cells read 0.91-1.13, since the attention core's backward runs in a
    fixed order (before, the same job's peak moved by up to 25% from one run to the next).
    It runs beside the rest of the suite: at a load of 5 nine cells read 0.91-1.07."""
    from runner.bench import estimate

    for factor, values in enumerate((estimate.PRECISIONS, estimate.DROPOUTS, estimate.POLICIES)):
        assert {cell[factor] for cell in estimate.EACH_VALUE} == set(values)
    assert set(estimate.EACH_VALUE) <= set(estimate.CELLS)
    quiet = ["trainer.progress=false", "trainer.save_model=false"]  # a kept model: ~1.3 s a job
    ratios = estimate.main(quiet, estimate.EACH_VALUE)
    low, high = estimate.BAND
    outside = {cell: v for cell, v in ratios.items() if not low <= v <= high}
    if outside:
        # The executor's order of independent ops moves a cell's peak between runs on some
        # machines (CI once read mixed/0.1/selective at 1.163, here 0.96-1.01 over three runs):
        # a cell outside the band is measured once more, in a fresh process, and must be in
        # it then. A rule that is wrong misses twice.
        again = estimate.main(quiet, list(outside))
        outside = {c: (v, again[c]) for c, v in outside.items() if not low <= again[c] <= high}
    assert not outside, (outside, ratios)
    verdicts = [ln for ln in capsys.readouterr().out.splitlines() if " cells (target: " in ln]
    assert verdicts[-1].endswith("0.85-1.15): ok"), verdicts


MLP_STACKS = r"""
import json, os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import keras
import tensorflow as tf
from models import memory_limited as ml
from tests.peaks import requested_peak


def mlp_stack(layers, h):
    # pre-LN MLP blocks (LayerNorm, Dense 4h with GELU, Dense h, residual) in mixed_bfloat16
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    inp = keras.Input((None, h))
    x = inp
    for _ in range(layers):
        y = ml.LayerNorm(epsilon=1e-5)(x)
        y = keras.layers.Dense(h)(keras.layers.Dense(4 * h, activation=ml.gelu)(y))
        x = keras.layers.Add()([x, y])
    keras.mixed_precision.set_global_policy("float32")
    return keras.Model(inp, x)


b, s, h = 8, 96, 64  # s*b != 16h: a block's activations (sbh) and kernel copies (16h^2) differ
tf.zeros((64 * 2**20 // 4,))  # the allocator's pool grown first, as the runner does
x = tf.random.normal((b, s, h))
peaks = {}
for layers in (6, 10):
    keras.backend.clear_session()
    model = mlp_stack(layers, h)

    @tf.function
    def step(x, model=model):
        with tf.GradientTape() as tape:
            out = tf.cast(model(x, training=True), tf.float32)
            loss = tf.reduce_sum(tf.square(out))
        grads = tape.gradient(loss, model.trainable_variables)
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    # the least of 3 traced calls: the rule is what a block must keep (one call beside the
    # suite's other worker held one more tensor)
    peaks[layers] = min(requested_peak(lambda step=step: step(x).numpy()) for _ in range(3))
print("RESULT " + json.dumps([peaks[6], peaks[10], b * s * h, 16 * h * h]))
"""


def test_gelu_and_layer_norm_hold_only_their_input_from_forward_to_backward():
    """A backward's terms that need only the layer's input (GELU's slope, LayerNorm's centred
    input, both float32) wait for the output gradient (memory_limited.after). Computed as soon
    as the input existed, the executor held them from the forward pass to the backward.
    Measured as what each block adds to the step's peak (10 blocks against 6, so the head and
    the transients cancel), in requested bytes with one inter-op thread (tests/peaks.py): a
    bfloat16 block keeps 20sbh bytes (the norm's and the first Dense's inputs, sbh each; GELU's
    and the second Dense's, 4sbh each, at 2 bytes) and its two kernels' bfloat16 copies
    (16h^2), and reads exactly that. With `after` returning x (the mutant) a block read
    27.4-31.9sbh against 21.3. Read in the allocator's chunks with two threads, the old form of
    this test (2 blocks against 6) read 19-25.6sbh and failed a CI run. In requested bytes with
    one thread the figure still followed Python's hash seed, which orders the graph's operations
    (tests/conftest.py ONE_THREAD): 19.33sbh with seed 3, 23.33 in two CI runs, 21.33 with seeds
    0, 1, 2, 4 and 5; with the seed pinned, a run of the suite beside a benchmark (issue 48) read
    23.33 again. The difference is one transient at one stack's peak, a [b, s, 4h] bfloat16
    tensor (8sbh bytes) more or less: a difference of two peaks is the blocks' own bytes within
    one transient over the 4 blocks between them (2sbh), which is the bound (19.33-23.33sbh
    around 21.33). In float32 (no cast to wait behind) the stack read 40-45sbh with and without
    the wait: not tested there."""
    small, large, sbh, copies = fresh_result(MLP_STACKS, env=ONE_THREAD, timeout=300)
    per_block = (large - small) / 4
    rule = 20 * sbh + copies
    transient = 8 * sbh / 4  # one [b, s, 4h] bfloat16 tensor at one peak, over 4 blocks
    slack = 0.01 * rule  # the allocator's rounding of requests
    low, high = rule - transient - slack, rule + transient + slack
    assert low <= per_block <= high, (small, large, per_block / sbh)
