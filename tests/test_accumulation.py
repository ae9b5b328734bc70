"""Gradient accumulation and loss scaling, checked against their definitions.

accum=4 x batch 8 must give the same update as accum=1 x batch 32 from the same start and
data; a non-finite gradient in any micro-batch must skip the whole optimizer step.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from models.spec import DataSpec
from models.transformer import build_transformer
from runner.techniques.accumulation import make_train_step
from runner.train.optimizer import build_optimizer
from tests.conftest import compose_config

SPEC = DataSpec("tokens", (8,), 10, vocab_size=16)  # classification: no BatchNorm, no dropout
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture
def policy():
    previous = keras.config.dtype_policy()
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy(previous)


def _data(n: int = 32):
    rng = np.random.default_rng(0)
    return rng.integers(0, 16, size=(n, 8)).astype(np.int32), rng.integers(0, 10, n).astype(
        np.int32
    )


def _step_weights(
    optimizer_name: str,
    accum: int,
    steps: int = 1,
    lr: float = 0.05,
    wrap=lambda opt: opt,
    jit: bool = False,
):
    """Weights after `steps` optimizer steps of the same 32 examples split into accum parts."""
    keras.utils.set_random_seed(0)
    model = build_transformer(SPEC, h=16, layers=1, heads=2)
    cfg = compose_config([f"trainer.optimizer={optimizer_name}", f"trainer.lr={lr}"])
    optimizer = wrap(build_optimizer(cfg.trainer))
    optimizer.build(model.trainable_variables)
    step = make_train_step(model, optimizer, LOSS, accum, jit)
    x, y = _data()
    xs, ys = x.reshape(accum, 32 // accum, 8), y.reshape(accum, 32 // accum)
    for _ in range(steps):
        loss, finite = step(zip(tf.constant(xs), tf.constant(ys), strict=True))
    return {w.path: w.numpy() for w in model.trainable_weights}, float(loss), optimizer


# The attention key bias has a true gradient of exactly 0 (softmax ignores a shift shared by
# all keys), so its computed gradient is rounding noise, which Adam (dividing by sqrt(v))
# turns into steps of up to lr either way. It is checked by the global figure only.
ZERO_GRADIENT = "attn/key/bias"


def _max_rel_diff(a: dict, b: dict) -> float:
    """Largest difference over all weights, relative to the largest weight."""
    diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in b)
    return diff / max(float(np.max(np.abs(y))) for y in b.values())


def assert_weights_close(a: dict, b: dict, rtol: float, atol: float) -> None:
    """Global max relative difference <= rtol, and element-wise |a - b| <= atol + rtol |b|."""
    assert a.keys() == b.keys()
    assert _max_rel_diff(a, b) <= rtol
    for key in b:
        if not key.endswith(ZERO_GRADIENT):
            np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=atol, err_msg=key)


# Adam divides by sqrt(v): a weight whose gradient is ~0 (rounding noise) moves by up to lr
# either way, so Adam runs at a typical lr of 1e-3 rather than SGD's 0.05.
@pytest.mark.parametrize(("optimizer_name", "lr"), [("sgd", 0.05), ("adam", 1e-3)])
def test_accum_4x8_equals_1x32_float32(optimizer_name, lr):
    big, big_loss, _ = _step_weights(optimizer_name, accum=1, lr=lr)
    accumulated, acc_loss, _ = _step_weights(optimizer_name, accum=4, lr=lr)
    assert_weights_close(accumulated, big, rtol=1e-5, atol=1e-7)
    assert acc_loss == pytest.approx(big_loss, rel=1e-5)  # the mean over the micro-batches


@pytest.mark.parametrize("jit", [False, True])
def test_each_step_starts_a_fresh_sum(jit):
    """The accumulators persist between steps: a sum carried into the next step would show
    from the second step on."""
    big, big_loss, _ = _step_weights("sgd", accum=1, steps=3, jit=jit)
    accumulated, acc_loss, _ = _step_weights("sgd", accum=4, steps=3, jit=jit)
    assert_weights_close(accumulated, big, rtol=1e-5, atol=1e-7)
    assert acc_loss == pytest.approx(big_loss, rel=1e-5)


def test_accum_equivalence_under_xla():
    big, _, _ = _step_weights("adam", accum=1, lr=1e-3, jit=True)
    accumulated, _, _ = _step_weights("adam", accum=4, lr=1e-3, jit=True)
    assert_weights_close(accumulated, big, rtol=1e-5, atol=1e-7)


def test_accum_equivalence_mixed_float16(policy):
    policy("mixed_float16")
    big, _, _ = _step_weights("sgd", accum=1, wrap=keras.optimizers.LossScaleOptimizer)
    accumulated, _, _ = _step_weights("sgd", accum=4, wrap=keras.optimizers.LossScaleOptimizer)
    # float16 has ~3 significant digits: tolerances of that order.
    assert_weights_close(accumulated, big, rtol=1e-2, atol=1e-4)


def test_a_step_draws_accum_micro_batches_in_order():
    """The step pulls exactly accum micro-batches per optimizer step from the pipeline, in
    order, and applies nothing when the pipeline runs dry mid-step."""
    keras.utils.set_random_seed(0)
    model = build_transformer(SPEC, h=16, layers=1, heads=2)
    optimizer = build_optimizer(
        compose_config(["trainer.optimizer=sgd", "trainer.lr=0.05"]).trainer
    )
    optimizer.build(model.trainable_variables)
    x, y = _data()
    expected = float(LOSS(y[:16], model(x[:16], training=True)))  # first step: 4 x 4 examples
    step = make_train_step(model, optimizer, LOSS, 4, jit_compile=False)
    drawn = []

    def micro_batches():
        for i in range(8):
            drawn.append(i)
            yield tf.constant(x[4 * i : 4 * i + 4]), tf.constant(y[4 * i : 4 * i + 4])

    batches = micro_batches()
    loss, _ = step(batches)
    assert drawn == [0, 1, 2, 3]
    assert float(loss) == pytest.approx(expected, rel=1e-5)  # mean over those four
    step(batches)
    assert drawn == list(range(8)) and int(optimizer.iterations.numpy()) == 2
    with pytest.raises(StopIteration):
        step(batches)
    assert int(optimizer.iterations.numpy()) == 2  # no update from a partial set


def test_updates_move_the_weights():
    """Guards the tests above: equal weights must not come from a step that does nothing."""
    keras.utils.set_random_seed(0)
    model = build_transformer(SPEC, h=16, layers=1, heads=2)
    start = {w.path: w.numpy() for w in model.trainable_weights}
    after, _, _ = _step_weights("sgd", accum=4)
    assert _max_rel_diff(after, start) > 1e-3


def _float_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3, dtype="float32")(keras.layers.Dense(8)(inputs))
    return keras.Model(inputs, outputs)


def test_fp16_overflow_in_one_micro_batch_skips_the_whole_step(policy):
    policy("mixed_float16")
    model = _float_model()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024.0)
    optimizer.build(model.trainable_variables)
    step = make_train_step(model, optimizer, LOSS, 4, jit_compile=False)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(4, 2, 4)).astype(np.float32)
    ys = rng.integers(0, 3, size=(4, 2)).astype(np.int32)
    poisoned = xs.copy()
    poisoned[2, 0, 0] = 1e6  # beyond float16's 65504: inf in micro-batch 3 only
    start = {w.path: w.numpy() for w in model.trainable_weights}

    _, finite = step(zip(tf.constant(poisoned), tf.constant(ys), strict=True))
    assert not bool(finite)
    for weight in model.trainable_weights:
        np.testing.assert_array_equal(start[weight.path], weight.numpy())  # no partial update
    assert float(optimizer.dynamic_scale.numpy()) == 512.0  # scale lowered
    assert int(optimizer.iterations.numpy()) == 0

    # The next clean step applies in full.
    _, finite = step(zip(tf.constant(xs), tf.constant(ys), strict=True))
    assert bool(finite) and int(optimizer.iterations.numpy()) == 1
    assert _max_rel_diff({w.path: w.numpy() for w in model.trainable_weights}, start) > 0


def test_lr_schedule_counts_optimizer_steps_not_micro_batches():
    cfg = compose_config(["trainer.schedule=cosine", "trainer.lr=0.1", "trainer.optimizer=sgd"])
    keras.utils.set_random_seed(0)
    model = build_transformer(SPEC, h=16, layers=1, heads=2)
    optimizer = build_optimizer(cfg.trainer, total_steps=10)
    optimizer.build(model.trainable_variables)
    step = make_train_step(model, optimizer, LOSS, 4, jit_compile=False)
    x, y = _data()
    for _ in range(3):
        step(zip(tf.constant(x.reshape(4, 8, 8)), tf.constant(y.reshape(4, 8)), strict=True))
    assert int(optimizer.iterations.numpy()) == 3
    expected = 0.1 * 0.5 * (1 + np.cos(np.pi * 3 / 10))  # cosine decay at step 3 of 10
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(expected, rel=1e-5)
