"""The backward walk's rules for a 16-bit policy's kernel copies (runner/estimate/graph_walk.py),
against the allocator's measured peak of a step: under mixed_bfloat16 every kernel is cast to
16 bits when the step starts (the casts read only variables, so the executor runs them first),
and each copy waits for its layer's input gradient; a rebuilt segment's kernels are cast twice
(its forward's copy, and its recomputation's, which waits), so a checkpointed model whose
activations are small peaks in its forward pass. The stack below is all kernels (3.25 MiB in
two copies) and little else (0.1 MiB of activations): without the copies the walk holds less
than half of what its step holds (2.1-2.4x short)."""

import pytest

from runner.estimate import conv_scratch
from tests.conftest import ONE_THREAD, fresh_result

KERNEL_COPIES = r"""
import json, os, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import keras
import tensorflow as tf
from runner.estimate import graph_walk, timeline
from runner.techniques import checkpointing
from tests.peaks import requested_peak, step_peak

policy = sys.argv[1]
keras.mixed_precision.set_global_policy("mixed_bfloat16")
inp = keras.Input((4, 4, 128))  # four 1x1 convolutions of 512 channels on 4x4 maps
h = inp
for k in range(4):
    h = keras.layers.Conv2D(512, 1, name=f"block_{k}_conv")(h)
    h = keras.layers.BatchNormalization(name=f"block_{k}_bn")(h)
    h = keras.layers.ReLU(name=f"block_{k}_relu")(h)
pooled = keras.layers.GlobalAveragePooling2D()(h)
stack = keras.Model(inp, keras.layers.Dense(10, dtype="float32")(pooled))
keras.mixed_precision.set_global_policy("float32")
tf.zeros((64 * 2**20 // 4,))  # the allocator's pool grown first, as the runner does
b = 2
x, y = tf.random.normal((b, 4, 4, 128)), tf.zeros((b,), tf.int32)
model, remat = checkpointing.apply(stack, policy, 1)
measured = step_peak(model, x, y, peak=requested_peak)
# An accumulating micro-batch's executor: each float32 weight gradient is consumed as it comes.
one_at_a_time = timeline.Executor(slots=1, per_byte=1.0)
kept, work, grads = graph_walk.walk_step(stack, b, 2, remat, one_at_a_time)
copies = sum(v.numpy().size for v in stack.trainable_variables if v.ndim > 1) * 2
print("RESULT " + json.dumps([measured, kept, work, grads, copies]))
"""


@pytest.mark.parametrize("policy", ["none", "every"])
def test_16_bit_kernel_copies_hold_the_measured_step(policy):
    """In a fresh process with one inter-op thread, read in requested bytes (tests/peaks.py).
    With the executor's two threads the step took three orders under `none` (0.79, 0.93 and
    1.07 of the walk in requested bytes; in the allocator's chunks 0.77, 0.93 and 1.21, which
    failed a CI run): the weight gradients of two layers alive at once or one after the other.
    With one thread it reads 0.96 under `none` in every run; under `every` 0.97 or 0.82 (below).
    The rule is about which copies are alive, not the executor's choice."""
    if not conv_scratch.onednn_convolutions("mixed_bfloat16"):
        # TensorFlow's own bfloat16 convolution kernels hold buffers of their own, and the
        # im2col rule was seen to overstate these 1x1 ones (0.73-0.78 with oneDNN off here).
        pytest.skip("bfloat16 convolutions take TensorFlow's own kernels on this CPU")
    measured, kept, work, grads, copies = fresh_result(
        KERNEL_COPIES, policy, env=ONE_THREAD, timeout=300
    )
    assert measured > copies  # the copies are most of the step
    # The rule keeps a copy through its own layer's backward, as MobileNetV3Small's trace (a
    # seed-29 draw) showed it beside the float32 weight gradient; under `every` the executor
    # frees it first in some runs, one thread or two (0.82: the last kernel's copy, 0.5 of
    # 2.9 MiB, gone before that layer's weight gradient is made): a bound, for that order. In
    # a CI run beside the suite's other worker and a busy machine it read 0.687 (2.33 MiB
    # against 3.38): the executor freed more copies still. So under `every` the rule is held
    # as a bound (never under), and `none`, whose order one thread fixes, holds it within 20%.
    low = 0.8 if policy == "none" else 0.6
    assert low <= measured / (kept + work + grads) <= 1.15, (measured, kept, work, grads)


FLOAT16_CONVOLUTIONS = r"""
import json, os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import keras
import tensorflow as tf
from runner.estimate import conv_scratch, executor_rules, graph_walk, timeline
from runner.techniques import checkpointing
from tests.peaks import step_peak

keras.mixed_precision.set_global_policy("mixed_float16")
inp = keras.Input((96, 96, 3))
first = keras.layers.Conv2D(32, 3, strides=2, padding="same")
h = keras.layers.Conv2D(64, 3, padding="same")(first(inp))
pooled = keras.layers.GlobalAveragePooling2D()(h)
cnn = keras.Model(inp, keras.layers.Dense(10, dtype="float32")(pooled))
keras.mixed_precision.set_global_policy("float32")
tf.zeros((256 * 2**20 // 4,))  # the allocator's pool grown first, as the runner does
b = 8
x, y = tf.random.normal((b, 96, 96, 3)), tf.zeros((b,), tf.int32)
measured = step_peak(cnn, x, y)
onednn = conv_scratch.onednn_convolutions("mixed_float16")
threads = executor_rules.threads(tf.config.threading.get_intra_op_parallelism_threads())
executor = timeline.Executor(conv_threads=0 if onednn else threads)
kept, work, _ = graph_walk.walk_step(cnn, b, 2, checkpointing.RematInfo(), executor)
other = 0 if onednn else conv_scratch.scratch_bytes(first, b, 2, False, threads)
print("RESULT " + json.dumps([onednn, measured, kept, work, other]))
"""


def test_float16_convolutions_hold_im2col_buffers_only_where_tensorflow_keeps_them():
    """Whether a float16 convolution's backward holds im2col buffers follows TensorFlow's own
    test (machine.cpu_onednn_fp16: AVX512BW with AVX512_FP16 or AMX_FP16, or AVX_NE_CONVERT,
    give float16 to oneDNN): on a CPU with AMX and AVX512_FP16 this step measured 8.6 MiB, the
    walk 7.9 without the buffers and 29.9 with them. Seed 29's draw 17 (MobileNetV2 in
    float16) had read 0.23 there, the buffers counted.

    Where TensorFlow's own kernels take them, the two filter gradients run one after the other
    or at once, as the executor's two threads happen to take them: on a 2-core AMD EPYC the
    allocator's trace read 30.5 MiB (the walk's one at a time, 29.9) in some calls and 42.9 in
    others, the second layer's 24.0 MiB buffer beside the first's 13.6 (the walk does not
    model the second order). It runs in a fresh process: in a suite worker, whose pool earlier
    tests had cut up, the same step read 1.61x the walk (chunks handed out whole)."""
    onednn, measured, kept, work, other = fresh_result(FLOAT16_CONVOLUTIONS, timeout=300)
    assert 0.85 * (kept + work) <= measured <= 1.15 * (kept + work + other), (
        onednn, measured, kept, work, other,
    )  # fmt: skip
