"""SGD with momentum computes m * momentum, which reads only its slot, for every variable when
the step starts (runner/estimate/executor_rules.py momentum_products): the walk holds those products
until each variable's gradient reaches its update, and an accumulating step's update call
holds all of them. Measured against the allocator's peak of a step in a fresh process."""

import pytest

from tests.conftest import fresh_result

# Serial (run alone, after the others): its rules say which updates the executor runs at
# once with two inter-op threads, and beside the suite's other worker that timing moved the
# figures past their bounds in CI runs
# (SGD's products at 0.687 of the rule at aaad562).
pytestmark = pytest.mark.serial


SCRIPT = r"""
import json, os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(2)
import keras
from omegaconf import OmegaConf
from runner.estimate import executor_rules, graph_walk
from runner.techniques.checkpointing import RematInfo
from tests.peaks import accumulating_peaks, dense_stack, grow_pool, most_peak, step_peak

grow_pool()
mlp = dense_stack(16, 512, 512)
x, y = tf.random.normal((1, 512)), tf.zeros((1,), tf.int32)
cfg = OmegaConf.create(
    {"accum": 1, "precision": {"policy": "float32"}, "distribution": {"strategy": "none"}}
)
out = {"weights": sum(v.numpy().size * 4 for v in mlp.trainable_variables)}
for momentum in (0.9, 0.0):
    sgd = keras.optimizers.SGD(1e-3, momentum=momentum)
    executor = executor_rules.executor(sgd, cfg, cpu_xla=False)
    out[f"products {momentum}"] = executor.slot_products
    out[f"measured {momentum}"] = step_peak(mlp, x, y, sgd, peak=most_peak)
    out[f"walk {momentum}"] = sum(graph_walk.walk_step(mlp, 1, 4, RematInfo(), executor))
    # An accumulating step's update call: the sums exist when it starts.
    sgd = keras.optimizers.SGD(1e-3, momentum=momentum)
    out[f"update {momentum}"] = accumulating_peaks(mlp, x, y, sgd, pick=max, calls_each=6)[1]
    rule = executor_rules.update_call_bytes(mlp.trainable_variables, sgd, 2)
    out[f"update rule {momentum}"] = rule
print("RESULT " + json.dumps(out))
"""


def test_sgd_momentum_products_are_alive_from_the_steps_start():
    # 17 Dense layers, 16.1 MiB of weights, batch 1: the products are the step's largest
    # tensors (16 MiB at the backward's start), the updates in flight 2 x 3 x 1 MiB. keras
    # ResNet50 under SGD had read 1.49x its estimate (128 MiB above its resting state, Adam 41).
    r = fresh_result(SCRIPT, timeout=300)
    assert (r["products 0.9"], r["products 0.0"]) == ("as_they_come", "")
    rule = r["walk 0.9"] - r["walk 0.0"]
    assert rule > 0.9 * r["weights"], r  # all of them, less the last layer's (consumed first)
    # The executor may run the last layers' updates before it has made the first layers'
    # products, so a single call held 0.69-1.00 of the rule (0.69 in a CI run beside the
    # suite's other worker). The rule is a bound: held against the most of 6 calls
    # (tests/peaks.py most_peak), 0.934-0.935 in four runs beside two busy processes. Without
    # the products the difference would be about 0.
    measured = r["measured 0.9"] - r["measured 0.0"]
    assert 0.85 <= measured / rule <= 1.15, r
    # The update call: every product (16 MiB) beside two updates' buffers (2 x 3 MiB). Its
    # sums exist when it starts, so some updates may run (and consume their products) before
    # the last products are made: single calls read 0.75-1.05 (0.749 in a CI run), the most
    # of 6 calls 0.999-1.046 in four runs beside two busy processes.
    rule = r["update rule 0.9"] - r["update rule 0.0"]
    assert rule == r["weights"], r
    measured = r["update 0.9"] - r["update 0.0"]
    assert 0.85 <= measured / rule <= 1.15, r
