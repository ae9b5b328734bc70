"""The allocator's peak of one training step, for the tests that hold the backward walk's rules
against it (test_conv_scratch, in a fresh process of its own; test_kernel_copies, in the
suite's), and of any computation (least_peak: test_chunked_attention). Import it after
TF_CPU_ALLOCATOR_USE_BFC is set: the CPU's peak needs the BFC allocator."""

import keras
import tensorflow as tf


def step_peak(model, x, y, optimizer=None) -> int:
    """Bytes the allocator holds above its resting state during a step (the least of 3, after a
    warm-up). Without an optimizer each gradient is consumed as it comes (none is held); with
    one, every gradient is checked, as runner/techniques/accumulation.py's update does, then
    applied."""
    variables = model.trainable_variables
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if optimizer is not None:
        optimizer.build(variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        if optimizer is None:  # each gradient consumed at once: none is held
            return tf.add_n([tf.reduce_sum(g) for g in grads])
        # as runner/techniques/accumulation.py's update: the check reads every gradient
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        optimizer.apply(grads, variables)
        return loss + tf.cast(finite, loss.dtype) * 0

    return least_peak(lambda: step(x, y).numpy())


def least_peak(compute) -> int:
    """Bytes the allocator holds above its resting state while `compute()` runs (it must wait
    for its result, e.g. read it with .numpy()): the least of 3, after a warm-up call."""
    compute()
    peaks = []
    for _ in range(3):
        tf.config.experimental.reset_memory_stats("CPU:0")
        rest = tf.config.experimental.get_memory_info("CPU:0")["current"]
        compute()
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - rest)
    return min(peaks)
