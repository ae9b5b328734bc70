"""The backward walk's two executor rules (runner/measure/backward.py Executor), each against
the allocator's measured peak of a step in a fresh process that pins what they depend on:
- TensorFlow's own CPU convolution kernels (TF_ENABLE_ONEDNN_OPTS=0) take im2col buffers
  sized to a 30 MiB working set, whatever the batch (runner/measure/conv_scratch.py);
- weight gradients are applied as they come, by as many updates at once as the executor has
  inter-op threads (2 here), each holding its gradient and Adam's two buffers; in an
  accumulating step's micro-batch each is added into its sum as it comes (one at a time), and
  the update's own call holds as many updates' buffers (runner/measure/steps.py).
Without either rule the estimate misses most of the step: the convolutions' tensors are under
1 MiB, and the Dense stack's gradients alone are a third of what its step holds."""

import pytest

from tests.conftest import onednn_off_result

# Serial (run alone, after the others): its rules say which updates the executor runs at
# once with two inter-op threads, and beside the suite's other worker that timing moved the
# figures past their bounds in CI runs
# (the update call at 1.135 of its bound at d4dbd6a, 0.35 at aaad562).
pytestmark = pytest.mark.serial


SCRIPT = r"""
import json, os, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(2)
import keras
from runner.measure import backward, conv_scratch, step_timeline, steps
from runner.techniques.checkpointing import RematInfo
from tests.peaks import accumulating_peaks, dense_stack, grow_pool, most_peak, step_peak

grow_pool()
out = {"onednn": conv_scratch.onednn()}
inp = keras.Input((51, 51, 3))
h = keras.layers.Conv2D(32, 3, strides=2, padding="same")(inp)
h = keras.layers.Conv2D(64, 3, padding="same")(h)
cnn = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
b = 3
x, y = tf.random.normal((b, 51, 51, 3)), tf.zeros((b,), tf.int32)
out["cnn"] = step_peak(cnn, x, y, None)
threads = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
for name, executor in [("cnn_rule", step_timeline.Executor(conv_threads=threads)),
                       ("cnn_without", step_timeline.Executor())]:
    kept, work, _ = backward.walk_step(cnn, b, 4, RematInfo(), executor)
    out[name] = kept + work

mlp = dense_stack(3, 2048, 192)
x, y = tf.random.normal((1, 192)), tf.zeros((1,), tf.int32)
out["mlp"] = step_peak(mlp, x, y, keras.optimizers.Adam(1e-3), peak=most_peak)
out["mlp_grads"] = sum(v.numpy().size * 4 for v in mlp.trainable_variables)
kept, work, grads = backward.walk_step(mlp, 1, 4, RematInfo(), step_timeline.Executor(2, 3))
out["mlp_rule"] = kept + work + grads
# The same stack in an accumulating step: each gradient added into its sum as it comes (a
# floor: the least of 3 calls), then the update's call (a bound: the most of 6).
adam = keras.optimizers.Adam(1e-3)
out["micro"] = accumulating_peaks(mlp, x, y, adam)[0]
out["update"] = accumulating_peaks(mlp, x, y, adam, pick=max, calls_each=6)[1]
kept, work, grads = backward.walk_step(mlp, 1, 4, RematInfo(), step_timeline.Executor(1, 1))
out["micro_rule"] = kept + work + grads
out["update_rule"] = steps.update_call_bytes(mlp.trainable_variables, adam, 2)
out["update_one"] = steps.update_call_bytes(mlp.trainable_variables, adam, 1)
print("RESULT " + json.dumps(out))
"""


def test_the_executor_rules_hold_the_measured_step():
    r = onednn_off_result(SCRIPT, timeout=300)
    assert r["onednn"] is False  # the switch conv_scratch reads follows the variable
    # The convolutions: the scratch is most of the step, and the rule holds it. Each filter
    # gradient's buffer is counted during its own backward; in some runs the executor ran the
    # two filter gradients at once (13.5 + 23.0 MiB: 1.45-1.52x the rule, more often beside
    # other tests), as the U-Net's and MobileNet's runs never did (1.00 at 5 micro-batches):
    # the bound is 1.6. Without the rule the ratio is above 20.
    assert r["cnn"] > 4 * r["cnn_without"], r
    assert 0.85 <= r["cnn"] / r["cnn_rule"] <= 1.6, r
    # The Dense stack: two 16 MiB kernels update at once, each with its gradient and two
    # buffers (96 MiB), where all gradients at once would be 34 MiB. How far the two updates
    # overlap is the executor's choice (a single call read 64-96 MiB), so the rule is a bound,
    # held against the most of 6 calls (tests/peaks.py most_peak): 0.999 in three runs beside
    # two busy processes.
    assert r["mlp"] > 1.8 * r["mlp_grads"], r
    assert 0.85 <= r["mlp"] / r["mlp_rule"] <= 1.05, r
    # Accumulating: a micro-batch holds one gradient at a time (16 MiB; measured 17.5 MiB in
    # all), not all of them (34 MiB) nor their update's buffers. Beside the other xdist worker
    # a fresh-clone CI run read 25.8 MiB (1.53x): the executor computed the next gradient
    # before the previous one's add had run. The rule is the least the step holds, so the
    # bound is 1.6. The update's call: as many updates at once as the executor chooses, one
    # or two (the rule the estimate uses, 96 MiB, is two: a bound as the accum=1 step's). Held
    # against the most of 6 calls: 0.667 of two in three runs beside two busy processes (one
    # update and a third of another); CI's serial stage at c1b3717 read one update exactly
    # (48.0 MiB, 1.000x one, 0.500x two). So the call lies between one update's buffers and
    # two's; counting the gradients alone (32 MiB for two) would fail the upper bound.
    assert 0.85 <= r["micro"] / r["micro_rule"] <= 1.6, r
    assert 0.95 * r["update_one"] <= r["update"] <= 1.05 * r["update_rule"], r
