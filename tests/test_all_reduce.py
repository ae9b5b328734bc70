"""Under a tf.distribute strategy Keras all-reduces every gradient in one call before it applies
any, and the collective all-reduce packs them into one tensor (runner/estimate/executor_rules.py
all_reduce_pack): each replica holds all its gradients and their pack, and an accumulating
step's update call the pack and the all-reduce's result (executor_rules.update_call_bytes). Measured
in requested bytes above the resting state (tests/peaks.py requested_peaks) of the project's
replicated step on 2 logical CPUs in a fresh process, 6 calls each."""

import pytest

from tests.conftest import fresh_result

# Serial (run alone, after the others): its figures are the executor's timing, which the
# suite's other worker moves (a replica's micro-batch at 1.16 and 4.23 MiB against 1.04-2.11
# here); the rules are bounds since they were measured beside busy processes.
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
from runner.estimate import executor_rules, graph_walk
from runner.techniques import accumulation
from runner.techniques.checkpointing import RematInfo
from tests.peaks import dense_stack, grow_pool, requested_peaks

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
       "measured": requested_peaks(lambda: step(iter([batch]))[0].numpy()),
       "pack": executor_rules.all_reduce_pack(mlp.trainable_variables)}
for name, distributed in (("rule", "mirrored"), ("one device", "none")):
    cfg = OmegaConf.create({"accum": 1, "precision": {"policy": "float32"},
                            "distribution": {"strategy": distributed}})
    # every gradient and their pack once the backward has ended (memory._gradient_bytes)
    waits_for = out["weights"] + executor_rules.all_reduce_pack(mlp.trainable_variables)
    executor = executor_rules.executor(adam, cfg, cpu_xla=False, gradients=waits_for)
    out[name] = sum(graph_walk.walk_step(mlp, 1, 4, RematInfo(), executor))

# accum=2: each micro-batch's gradient added into the replica's sum as it comes (the replica's
# function is inlined without XLA), then the update's call all-reduces the sums
with strategy.scope():
    mlp2 = dense_stack(16, 512, 512)
    adam2 = keras.optimizers.Adam(1e-3)
    adam2.build(mlp2.trainable_variables)
step2 = accumulation.make_train_step(mlp2, adam2, loss_fn, 2, False, strategy=strategy)
step2(iter([batch] * 2))
calls = dict(zip(step2.__code__.co_freevars, [c.cell_contents for c in step2.__closure__]))
out["micro"] = requested_peaks(lambda: calls["add_micro_batch"](*batch, False).numpy())
out["update"] = requested_peaks(lambda: calls["apply_sum"]([tf.constant(0.0)] * 2)[0].numpy())
cfg = OmegaConf.create({"accum": 2, "precision": {"policy": "float32"},
                        "distribution": {"strategy": "mirrored"}})
executor = executor_rules.executor(adam2, cfg, cpu_xla=False)
kept, work, in_flight = graph_walk.walk_step(mlp2, 1, 4, RematInfo(), executor)
# as the estimate counts them: the walk's in flight, or every gradient when it has no slots
out["micro rule"] = kept + work + (in_flight if executor.slots else out["weights"] + in_flight)
out["micro kept"] = kept + work  # a replica's activations and workspace at that peak
out["update rule"] = executor_rules.update_call_bytes(
    mlp2.trainable_variables, adam2, executor_rules.inter_op_threads(), True)
out["largest"] = max(v.numpy().size * 4 for v in mlp2.trainable_variables)
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
    # The logical CPUs share one allocator, and each replica reaches its peak when its own
    # backward ends, so the two peaks meet only when the replicas keep pace. The rule bounds
    # the most of 6 calls. What every call must hold: the replica that packs last holds its
    # gradients and their pack while the other's pack waits in the collective for it, the
    # rule and one pack (0.75 of both replicas' rules). Read in requested bytes: 0.88-1.00
    # of both replicas' rules, alone and beside a busy process; the issue-48 run's 0.77 (the
    # allocator's least of 3 calls, beside two busy processes) was above that floor.
    both = r["replicas"] * r["rule"]
    print(
        f"step over both replicas' rules: {min(r['measured']) / both:.3f}-"
        f"{max(r['measured']) / both:.3f} (floor {(r['rule'] + r['pack']) / both:.3f})"
    )
    assert max(r["measured"]) <= 1.05 * both, r
    assert min(r["measured"]) >= 0.95 * (r["rule"] + r["pack"]), r


def test_an_accumulating_replica_all_reduces_its_sums_in_the_update_call(r):
    # The same stack at accum=2: a micro-batch adds each gradient into its sum on the thread
    # that computed it (the replica's function is inlined; under XLA its outputs, all 16 MiB
    # a replica, are measured apart), and the update's call holds the pack and the
    # all-reduce's result, then the result beside Adam's waiting buffers. The two replicas
    # share the two inter-op threads, so both together compute two gradients at once, one
    # replica's rule beside the other's activations: 2.04-2.11 MiB alone and beside a busy
    # process. With the sum read for `s + g` (before the rule was made a bound) a gradient
    # also waited for that read, and the micro-batch read 2.1-9.1 MiB (4.23 in a CI run at
    # 5757717). Every call holds at least one gradient.
    assert r["micro rule"] < 0.25 * r["weights"], r
    both = r["micro rule"] + (r["replicas"] - 1) * r["micro kept"]
    assert r["largest"] <= min(r["micro"]) and max(r["micro"]) <= 1.05 * both, r
    # The update's call, a replica's share (the most of 6 calls): 30.0-32.1 MiB, the rule 34.1
    # (the pack and the result, then the result, every variable's waiting buffer and two
    # threads' chains); the pack alone, as counted before the all-reduce rule, 22.
    per_replica = max(r["update"]) / r["replicas"]
    print(
        f"micro-batch {max(r['micro']) / both:.3f} of a replica's rule (both replicas), "
        f"update call {per_replica / r['update rule']:.3f} of the rule a replica"
    )
    assert r["update rule"] >= 2 * r["weights"], r
    assert 0.85 * r["update rule"] <= per_replica <= 1.05 * r["update rule"], r
