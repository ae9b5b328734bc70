"""The backward walk's two executor rules (runner/estimate/graph_walk.py Executor), each against
the allocator's measured peak of a step in a fresh process that pins what they depend on:
- TensorFlow's own CPU convolution kernels (TF_ENABLE_ONEDNN_OPTS=0) take im2col buffers
  sized to a 30 MiB working set, whatever the batch (runner/estimate/conv_scratch.py);
- weight gradients are applied as they come, by as many updates at once as the executor has
  inter-op threads (2 here), each holding its gradient and Adam's two buffers; in an
  accumulating step's micro-batch each is added into its sum on the thread that computed it
  (as many at once as threads), and the update's own call holds a waiting buffer of every
  variable beside the threads' chains (runner/estimate/executor_rules.py). These are bounds: each is
  held against the most of 6 calls, read in requested bytes above the resting state
  (tests/peaks.py requested_peaks).
Without either rule the estimate misses most of the step: the convolutions' tensors are under
1 MiB, and the Dense stack's gradients alone are a third of what its step holds."""

import pytest

from tests.conftest import onednn_off_result

# Serial (run alone, after the others): its figures are the executor's timing, which the
# suite's other worker moves (the update call at 1.135 of its old rule at d4dbd6a, 0.35 at
# aaad562); the rules are bounds since they were measured beside two busy processes.
pytestmark = pytest.mark.serial


SCRIPT = r"""
import json, os, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(2)
import keras
from omegaconf import OmegaConf
from runner.estimate import conv_scratch, executor_rules, graph_walk, timeline
from runner.techniques.checkpointing import RematInfo
from tests.peaks import accumulating_calls, dense_stack, grow_pool, requested_peaks, step_peak

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
for name, executor in [("cnn_rule", timeline.Executor(conv_threads=threads)),
                       ("cnn_without", timeline.Executor())]:
    kept, work, _ = graph_walk.walk_step(cnn, b, 4, RematInfo(), executor)
    out[name] = kept + work

# The Dense stacks' steps read in requested bytes (the profiler's memory events), 6 calls each:
# these rules say which tensors the executor holds at once, not which chunks the allocator
# hands out (tests/peaks.py); the allocator's share is the estimate's own term.
float32 = {"precision": {"policy": "float32"}, "distribution": {"strategy": "none"}}
one, two = (OmegaConf.create({"accum": a, **float32}) for a in (1, 2))
mlp = dense_stack(3, 2048, 192)
x, y = tf.random.normal((1, 192)), tf.zeros((1,), tf.int32)
adam = keras.optimizers.Adam(1e-3)
out["mlp"] = step_peak(mlp, x, y, adam, peak=requested_peaks)
out["mlp_grads"] = sum(v.numpy().size * 4 for v in mlp.trainable_variables)
executor = executor_rules.executor(adam, one, False)
kept, work, grads = graph_walk.walk_step(mlp, 1, 4, RematInfo(), executor)
out["mlp_rule"] = kept + work + grads
# The same stack in an accumulating step: a micro-batch adds each gradient into its sum as it
# comes, the update's own call applies the sums.
adam = keras.optimizers.Adam(1e-3)
micro, update = accumulating_calls(mlp, x, y, adam)
out["micro"], out["update"] = requested_peaks(micro), requested_peaks(update)
executor = executor_rules.executor(adam, two, False)
kept, work, grads = graph_walk.walk_step(mlp, 1, 4, RematInfo(), executor)
out["micro_rule"] = kept + work + grads
out["largest"] = max(v.numpy().size * 4 for v in mlp.trainable_variables)
out["update_rule"] = executor_rules.update_call_bytes(mlp.trainable_variables, adam, 2)
# Fifteen 1 MiB kernels: many more updates than threads in the update's call.
deep = dense_stack(16, 512, 192)
adam = keras.optimizers.Adam(1e-3)
out["deep_update"] = requested_peaks(accumulating_calls(deep, x, y, adam)[1])
out["deep_update_rule"] = executor_rules.update_call_bytes(deep.trainable_variables, adam, 2)
out["deep_largest"] = max(v.numpy().size * 4 for v in deep.trainable_variables)
print("RESULT " + json.dumps(out))
"""


def test_the_executor_rules_hold_the_measured_step():
    r = onednn_off_result(SCRIPT, timeout=300)
    assert r["onednn"] is False  # the switch conv_scratch reads follows the variable
    # what a failure, or `-rP`, shows of the run: each figure over its rule
    mib = 2**20
    print(
        f"cnn {r['cnn'] / r['cnn_rule']:.3f}; most of 6 over the rule: "
        f"mlp {max(r['mlp']) / r['mlp_rule']:.3f}, micro {max(r['micro']) / r['micro_rule']:.3f},"
        f" update {max(r['update']) / r['update_rule']:.3f}, fifteen kernels' update "
        f"{max(r['deep_update']) / r['deep_update_rule']:.3f} ({max(r['deep_update']) / mib:.1f}"
        f" MiB); micro's least {min(r['micro']) / mib:.1f} MiB"
    )
    # The convolutions: the scratch is most of the step, and the rule holds it. Each filter
    # gradient's buffer is counted during its own backward; in some runs the executor ran the
    # two filter gradients at once (13.5 + 23.0 MiB: 1.45-1.52x the rule, more often beside
    # other tests), as the U-Net's and MobileNet's runs never did (1.00 at 5 micro-batches):
    # the bound is 1.6. Without the rule the ratio is above 20.
    assert r["cnn"] > 4 * r["cnn_without"], r
    assert 0.85 <= r["cnn"] / r["cnn_rule"] <= 1.6, r
    # The Dense stacks' rules are bounds on what the executor may hold at once
    # (runner/estimate/executor_rules.py): held against the most of 6 calls, and each must be
    # reached in some call, or the bound says nothing. Which calls reach it is the executor's
    # timing: beside two busy processes more calls did.
    # accum=1, two 16 MiB kernels: two updates at once, each its gradient and Adam's two
    # buffers (96 MiB), where all gradients at once would be 34 MiB: 80-96 MiB a call, the
    # most 96.0 in every run here. Issue 48's 1.135 (109 MiB in the allocator's chunks, no sum
    # of 16 MiB buffers) was most likely a chunk larger than its request; not reproduced. On
    # five 4 MiB kernels the same rule read 6.0 kernels in every call, alone and beside a busy
    # process.
    assert r["mlp_rule"] > 2.8 * r["mlp_grads"], r
    assert 0.85 <= max(r["mlp"]) / r["mlp_rule"] <= 1.05, r
    # Accumulating: a micro-batch adds each gradient into its sum on the thread that computed
    # it, so as many gradients are alive as threads compute them: 17.5 MiB (one) or 32.0
    # (both) alone, 32.0 in every call beside two busy processes (where the one-at-a-time
    # rule read 1.90 in the allocator's chunks). Every call holds at least one gradient.
    assert max(r["micro"]) <= 1.05 * r["micro_rule"], r
    assert min(r["micro"]) >= r["largest"], r
    # The update's call: every update's first operations are ready when it starts, so every
    # variable may hold a buffer waiting for its other branch beside the two threads'
    # chains: 64.0-65.7 MiB (the bound 65.6), 48.0 at the least; fifteen 1 MiB kernels 7-12
    # MiB (the bound 17.4; two updates with their gradients, the old rule, 6). The least a
    # call holds is one update's two branches.
    assert 0.6 <= max(r["update"]) / r["update_rule"] <= 1.05, r
    assert min(r["update"]) >= 2 * r["largest"], r
    # Fifteen 1 MiB kernels reach the bound in fewer calls (7-12 MiB of 17.4), but more than
    # two updates' buffers are alive in every run: the waiting ones.
    assert 1.2 * 2 * 3 * r["deep_largest"] <= max(r["deep_update"]), r
    assert max(r["deep_update"]) <= 1.05 * r["deep_update_rule"], r
