"""Under a tf.distribute strategy Keras all-reduces every gradient in one call before it applies
any, and the collective all-reduce packs them into one tensor (runner/measure/steps.py
all_reduce_pack): each replica holds all its gradients and their pack, and an accumulating
step's update call the pack and the all-reduce's result (steps.update_call_bytes). Measured
against the allocator's peak of the project's replicated step on 2 logical CPUs in a fresh
process."""

import pytest

from tests.conftest import fresh_result

# Serial (run alone, after the others): its rules say which updates the executor runs at
# once with two inter-op threads, and beside the suite's other worker that timing moved the
# figures past their bounds in CI runs
# (a replica's micro-batch at 1.16 and 4.23 MiB against 1.04-2.11 here).
pytestmark = pytest.mark.serial


SCRIPT = r"""
import json, os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import tensorflow as tf
from runner.techniques import distribution
distribution.split_cpu(2)
tf.config.threading.set_inter_op_parallelism_threads(2)
import keras
from omegaconf import OmegaConf
from runner.measure import backward, steps
from runner.techniques import accumulation
from runner.techniques.checkpointing import RematInfo
from tests.peaks import dense_stack, grow_pool, least_peak, most_peak

grow_pool()
strategy = distribution.make_strategy(OmegaConf.create({"strategy": "mirrored", "devices": None,
                                                        "logical_cpus": 0}), [])
with strategy.scope():
    mlp = dense_stack(16, 512, 512)
    adam = keras.optimizers.Adam(1e-3)
    adam.build(mlp.trainable_variables)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
step = accumulation.make_train_step(mlp, adam, loss_fn, 1, False, strategy=strategy)
x, y = tf.random.normal((2, 512)), tf.zeros((2,), tf.int32)
batch = strategy.experimental_distribute_values_from_function(lambda ctx: (x[:1], y[:1]))
out = {"replicas": strategy.num_replicas_in_sync,
       "weights": sum(v.numpy().size * 4 for v in mlp.trainable_variables),
       "measured": least_peak(lambda: step(iter([batch]))[0].numpy())}
for name, distributed in (("rule", "mirrored"), ("one device", "none")):
    cfg = OmegaConf.create({"accum": 1, "precision": {"policy": "float32"},
                            "distribution": {"strategy": distributed}})
    # every gradient and their pack once the backward has ended (estimate._gradient_bytes)
    waits_for = out["weights"] + steps.all_reduce_pack(mlp.trainable_variables)
    executor = steps.executor(adam, cfg, cpu_xla=False, gradients=waits_for)
    out[name] = sum(backward.walk_step(mlp, 1, 4, RematInfo(), executor))

# accum=2: each micro-batch's gradient added into the replica's sum as it comes (the replica's
# function is inlined without XLA), then the update's call all-reduces the sums
with strategy.scope():
    mlp2 = dense_stack(16, 512, 512)
    adam2 = keras.optimizers.Adam(1e-3)
    adam2.build(mlp2.trainable_variables)
step2 = accumulation.make_train_step(mlp2, adam2, loss_fn, 2, False, strategy=strategy)
step2(iter([batch] * 2))
calls = dict(zip(step2.__code__.co_freevars, [c.cell_contents for c in step2.__closure__]))
out["micro"] = least_peak(lambda: calls["add_micro_batch"](*batch, False).numpy())
out["update"] = most_peak(lambda: calls["apply_sum"]([tf.constant(0.0)] * 2)[0].numpy())
cfg = OmegaConf.create({"accum": 2, "precision": {"policy": "float32"},
                        "distribution": {"strategy": "mirrored"}})
executor = steps.executor(adam2, cfg, cpu_xla=False)
kept, work, in_flight = backward.walk_step(mlp2, 1, 4, RematInfo(), executor)
# as the estimate counts them: the walk's in flight, or every gradient when it has no slots
out["micro rule"] = kept + work + (in_flight if executor.slots else out["weights"] + in_flight)
out["update rule"] = steps.update_call_bytes(
    mlp2.trainable_variables, adam2, steps.inter_op_threads(), True)
# two updates at once, each its gradient and Adam's two buffers of its kernel's size
out["two updates"] = 2 * 3 * max(v.numpy().size * 4 for v in mlp2.trainable_variables)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def r() -> dict:
    """Both tests' figures, from one fresh process."""
    return fresh_result(SCRIPT, timeout=300)


def test_each_replica_holds_its_gradients_and_their_all_reduce_pack(r):
    # 17 Dense layers (16.1 MiB of weights) at one example a replica: the gradients and their
    # pack (32 MiB a replica) are the step; one device applies each gradient as it comes (two
    # updates of 1 MiB kernels at once). The mirrored draws of seed 31 had read 1.16-1.58x
    # their estimate without the rule.
    assert r["replicas"] == 2
    assert r["rule"] > 1.9 * r["weights"] > 4 * r["one device"], r
    per_replica = r["measured"] / r["replicas"]  # logical CPUs share one allocator
    assert 0.85 <= per_replica / r["rule"] <= 1.15, r


def test_an_accumulating_replica_all_reduces_its_sums_in_the_update_call(r):
    # The same stack at accum=2: a micro-batch holds one gradient at a time (the replica's
    # function is inlined; under XLA its outputs, all 16 MiB a replica, measured apart), and
    # the update's call the pack and the all-reduce's result, two copies of the weights a
    # replica (29-37 MiB measured, the rule 32; the pack alone, as counted before, 22).
    # The replicas run their micro-batches apart, so their peaks need not meet, and beside
    # other work the executor computes gradients before their adds: the shared allocator read
    # 2.11 MiB in runs here, 1.16 (one replica, 1.07x the rule) and 4.23 (3.9x) in CI runs at
    # a622292 and 5757717. The rule is a floor; all gradients (16 MiB a replica) never came.
    assert r["micro"] >= 0.85 * r["micro rule"], r
    assert r["micro"] < 0.25 * r["weights"] * r["replicas"], r
    assert r["micro rule"] < 0.25 * r["weights"], r
    per_replica = r["update"] / r["replicas"]
    assert r["update rule"] >= 2 * r["weights"], r
    # The most of 6 calls; the executor may start the first updates before the pack is freed:
    # a CI run alone (serial, at f50d5a9) read 38.8 MiB a replica, 1.152x the rule, 5.1 MiB
    # above it, under the buffers of the two updates the executor runs at once (6 MiB).
    assert 0.85 * r["update rule"] <= per_replica <= r["update rule"] + r["two updates"], r
