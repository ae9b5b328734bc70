"""Pruning against tensorflow-model-optimization 0.8.1 itself (issue 13): its Pruning class
and a tf_keras `fit` with its wrapper, beside tfmemlab's Pruner on the same kernels and steps.

tfmot and tf_keras are in the dev extra: without them these tests fail, they do not skip.
"""

import importlib
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from runner.schedules.m_by_n import m_by_n_mask
from runner.techniques import pruning
from runner.techniques.accumulation import make_train_step
from tests.conftest import compose_config


@pytest.fixture(scope="module")
def tfmot():
    """tfmot's sparsity modules and tf_keras. Importing tfmot sets TF_USE_LEGACY_KERAS=1 for
    the whole process (tensorflow_model_optimization/python/core/keras/compat.py), which
    would turn later subprocesses' tf.keras into Keras 2: the variable is put back."""
    saved = os.environ.get("TF_USE_LEGACY_KERAS")
    try:
        base = "tensorflow_model_optimization.python.core.sparsity.keras."
        names = ("pruning_impl", "pruning_schedule", "pruning_utils", "prune", "pruning_callbacks")
        modules = {name: importlib.import_module(base + name) for name in names}
        modules["tf_keras"] = importlib.import_module("tf_keras")
    finally:
        if saved is None:
            os.environ.pop("TF_USE_LEGACY_KERAS", None)
        else:
            os.environ["TF_USE_LEGACY_KERAS"] = saved
    return modules


def tfmot_schedule(tfmot, p):
    """tfmot's schedule for the same keys (end_step here is on the frequency grid)."""
    schedules = tfmot["pruning_schedule"]
    if p.schedule == "constant":
        return schedules.ConstantSparsity(p.target_sparsity, p.begin_step, -1, p.frequency)
    return schedules.PolynomialDecay(
        p.initial_sparsity, p.target_sparsity, p.begin_step, p.end_step, p.power, p.frequency
    )


def conv_model():
    """A first conv (left dense), a second conv and a Dense: two pruned kernels, 576 + 160."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6, 6, 4)),
            keras.layers.Conv2D(8, 3),
            keras.layers.Conv2D(8, 3),
            keras.layers.Flatten(),
            keras.layers.Dense(5),
        ]
    )


STEPS = 16
SCHEDULES = {
    # tfmot's defaults but frequency: begin 0, so the first choice is at step 4
    "constant": ["pruning=constant", "pruning.frequency=4"],
    # choices at 2, 5, 8, 11, 14: the first after one trained step; power 2, not 3
    "polynomial": [
        "pruning=polynomial",
        "pruning.initial_sparsity=0.1",
        "pruning.target_sparsity=0.8",
        "pruning.begin_step=2",
        "pruning.end_step=14",
        "pruning.frequency=3",
        "pruning.power=2",
    ],
}


@pytest.mark.parametrize(("name", "jit"), [("constant", False), ("polynomial", True)])
def test_masks_and_weights_equal_tfmot_pruning_at_every_step(tfmot, name, jit):
    """tfmot's Pruning driven as its wrapper drives it (pruning_wrapper.py:285-321: step += 1,
    conditional_mask_update, weight <- weight x mask, forward) and the Pruner in a compiled step,
    both given the same update each step, pruned weights included: masks and the weights the
    forward pass sees are identical at every step, and pruned weights do grow back."""
    keras.backend.clear_session()
    cfg = compose_config(SCHEDULES[name])
    model = conv_model()
    optimizer = keras.optimizers.SGD(1.0)  # w - 1 x (-delta) == w + delta, bit for bit
    pruner = pruning.Pruner(model, cfg.pruning, STEPS, optimizer)
    assert [v.path.split("/")[-2] for v in pruner.kernels] == ["conv2d_1", "dense"]
    theirs = [tf.Variable(v.numpy()) for v in pruner.kernels]
    their_masks = [tf.Variable(tf.ones_like(v)) for v in theirs]
    thresholds = [tf.Variable(0.0) for _ in theirs]
    their_step = tf.Variable(0, dtype=tf.int64)  # UpdatePruningStep.on_train_begin sets 0
    impl = tfmot["pruning_impl"].Pruning(
        lambda: their_step,
        list(zip(theirs, their_masks, thresholds, strict=True)),
        tfmot_schedule(tfmot, cfg.pruning),
        (1, 1),
        "AVG",
    )

    @tf.function(jit_compile=jit)
    def our_step(deltas):
        optimizer.apply([-d for d in deltas], pruner.kernels)
        pruner.after_update()

    rng = np.random.default_rng(1)
    pruned_before, regrown = None, 0
    for step in range(1, STEPS + 1):
        their_step.assign(step)  # the wrapper's call, in order
        impl.conditional_mask_update()
        impl.weight_mask_op()
        for mine, mask, their, their_mask in zip(
            pruner.kernels, pruner.masks, theirs, their_masks, strict=True
        ):
            np.testing.assert_array_equal(mask.numpy(), their_mask.numpy(), f"step {step}")
            np.testing.assert_array_equal(mine.numpy(), their.numpy(), f"step {step}")
        pruned = np.concatenate([m.numpy().ravel() == 0 for m in their_masks])
        if pruned_before is not None:
            regrown += int((pruned_before & ~pruned).sum())
        pruned_before = pruned
        deltas = [tf.constant(rng.normal(0, 0.05, v.shape), tf.float32) for v in theirs]
        for their, delta in zip(theirs, deltas, strict=True):
            their.assign_add(delta)  # the optimizer's update, pruned weights included
        our_step(deltas)
    assert pruner.updates == [
        (t, pytest.approx(float(tfmot_schedule(tfmot, cfg.pruning)(t)[1])))
        for t in range(1, STEPS + 1)
        if bool(tfmot_schedule(tfmot, cfg.pruning)(t)[0])
    ]
    assert regrown > 0, "no pruned weight grew back: the comparison would not test regrowth"


@pytest.mark.parametrize("shape", [(16, 8), (3, 3, 8, 4)], ids=["dense", "conv2d"])
def test_two_of_four_masks_equal_tfmot(tfmot, shape):
    weights = tf.constant(np.random.default_rng(2).normal(size=shape), tf.float32)
    impl = tfmot["pruning_impl"].Pruning(lambda: 1, [], None, (1, 1), "AVG", (2, 4))
    theirs = impl._update_mask_sparsity_m_by_n(weights, (2, 4))
    ours = m_by_n_mask(tf.abs(weights), (len(shape) - 2,), 2, 4)
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_fit_with_tfmot_wrapper_matches_our_train_step(tfmot):
    """tf_keras `fit` with prune_low_magnitude and UpdatePruningStep beside tfmemlab's compiled
    step and Pruner: same kernel, data and SGD. Masks equal at every step (tfmot chooses at the
    start of step t, we at the end of step t - 1), weights equal to float rounding."""
    tfk, prune = tfmot["tf_keras"], tfmot["prune"]
    cfg = compose_config(["pruning=constant", "pruning.frequency=3"])
    steps, batch = 12, 8
    rng = np.random.default_rng(3)
    x = rng.normal(size=(steps * batch, 8)).astype("float32")
    y = rng.normal(size=(steps * batch, 4)).astype("float32")
    schedule = tfmot_schedule(tfmot, cfg.pruning)
    wrapped = prune.prune_low_magnitude(
        tfk.layers.Dense(4, use_bias=False), pruning_schedule=schedule
    )
    theirs = tfk.Sequential([tfk.Input((8,)), wrapped])
    theirs.compile(tfk.optimizers.SGD(0.3), "mse")
    keras.backend.clear_session()
    ours = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, use_bias=False)])
    ours.set_weights([wrapped.layer.kernel.numpy()])
    optimizer = keras.optimizers.SGD(0.3)
    pruner = pruning.Pruner(ours, cfg.pruning, steps, optimizer)

    def mse(targets, outputs):  # tf_keras's "mse": mean over features, then over the batch
        return tf.reduce_mean(tf.reduce_mean(tf.square(targets - outputs), axis=-1))

    our_step = make_train_step(ours, optimizer, mse, 1, False, pruner.after_update)
    seen = []  # tfmot's mask during step t and its kernel after step t's update

    class Record(tfk.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            mask = wrapped.pruning_vars[0][1].numpy()
            seen.append((mask, wrapped.layer.kernel.numpy()))

    callbacks = [tfmot["pruning_callbacks"].UpdatePruningStep(), Record()]
    theirs.fit(x, y, batch_size=batch, shuffle=False, callbacks=callbacks, verbose=0)
    batches = iter(zip(np.split(x, steps), np.split(y, steps), strict=True))
    first_choice = None
    for step in range(1, steps + 1):
        our_step(batches)  # leaves the masks of step + 1
        if step < steps:
            their_mask, their_kernel = seen[step]
            np.testing.assert_array_equal(pruner.masks[0].numpy(), their_mask, f"step {step}")
            expected = seen[step - 1][1] * their_mask
            np.testing.assert_allclose(pruner.kernels[0].numpy(), expected, rtol=1e-5, atol=1e-6)
        if first_choice is None and (pruner.masks[0].numpy() == 0).any():
            first_choice = step + 1
    assert first_choice == 3  # tfmot's begin 0, frequency 3: after 2 trained steps
    # After the run UpdatePruningStep.on_epoch_end masks the kernel; so does our last step.
    np.testing.assert_allclose(
        pruner.kernels[0].numpy(), wrapped.layer.kernel.numpy(), rtol=1e-5, atol=1e-6
    )
    masks = [mask for mask, _ in seen]
    assert any(((a == 0) & (b == 1)).any() for a, b in zip(masks, masks[1:], strict=False))
