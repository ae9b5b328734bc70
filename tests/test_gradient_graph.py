"""Which gradients a training step computes, and how long a waiting step holds them, in the
backward walk (runner/estimate/graph_walk.py), against the allocator's peak of a step in a fresh
process with TensorFlow's own CPU convolution kernels (their im2col buffers, conv_scratch.py,
make the difference large):
- TensorFlow prunes the gradients no weight needs: a convolution that reads a Rescaling of the
  model's input (MobileNetV3's and EfficientNet's first) computes no input gradient, so its
  backward takes the filter gradient's buffer only;
- a step that waits for every gradient before its update (loss scaling's check, a strategy's
  all-reduce) holds each from its layer's backward on, and their quotients only once the
  backward has ended: not all of them twice beside the backward's peak;
- a backbone nested in the model as one layer runs its own operations: the walk reads them;
  frozen, it runs no backward and computes as in inference, elementwise layers in place;
- a layer called twice (a siamese pair's backbone, a shared head) runs at each call.
Seed 867896's draw 24 (MobileNetV3Small, 46 px, batch 11, mixed, selective) read 0.805 of its
estimate, which had counted both: 0.972 with the rules."""

from tests.conftest import onednn_off_result

SCRIPT = r"""
import json, os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(2)
import keras
from omegaconf import OmegaConf
from runner.estimate import executor_rules, graph_walk, timeline
from runner.techniques import accumulation
from runner.techniques.checkpointing import RematInfo
from tests.peaks import grow_pool, least_peak, most_peak, step_peak

grow_pool()
L = keras.layers
out = {}
# A convolution that reads a Rescaling of the model's input: its input gradient is never computed.
inp = keras.Input((51, 51, 3))
h = L.Conv2D(8, 3, padding="same")(L.Rescaling(1 / 127.5, -1)(inp))
rescaled = keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))
b = 3
x, y = tf.random.normal((b, 51, 51, 3)), tf.zeros((b,), tf.int32)
threads = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
executor = timeline.Executor(conv_threads=threads)
out["rescaled"] = step_peak(rescaled, x, y, None)
out["rescaled rule"] = sum(graph_walk.walk_step(rescaled, b, 4, RematInfo(), executor))
out["rescaled with input gradient"] = sum(
    graph_walk.walk_step(rescaled, b, 4, RematInfo(), executor, input_gradient=True))
# A loss-scaled step: a convolution's filter gradient (its im2col buffer) runs last, when
# every Dense gradient exists (16 MiB), but not yet their quotients.
inp = keras.Input((51, 51, 3))
h = L.GlobalAveragePooling2D()(L.Conv2D(8, 3, padding="same")(inp))
for _ in range(16):
    h = L.Dense(512, activation="relu")(h)
stack = keras.Model(inp, L.Dense(10)(h))
out["weights"] = sum(v.numpy().size * 4 for v in stack.trainable_variables)
optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3))
optimizer.build(stack.trainable_variables)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
step = accumulation.make_train_step(stack, optimizer, loss_fn, 1, False)
out["scaled"] = least_peak(lambda: step(iter([(x, y)]))[0].numpy())
cfg = OmegaConf.create({"accum": 1, "precision": {"policy": "float32"},
                        "distribution": {"strategy": "none"}})
both = 2 * out["weights"]  # the scaled gradients and their quotients (memory._gradient_bytes)
executor = executor_rules.executor(optimizer, cfg, cpu_xla=False, gradients=both)
out["scaled rule"] = sum(graph_walk.walk_step(stack, b, 4, RematInfo(), executor))
waits = executor_rules.executor(optimizer, cfg, False)
kept, work, _ = graph_walk.walk_step(stack, b, 4, RematInfo(), waits)
out["scaled beside all"] = kept + work + both
# A backbone nested as one layer of the model (a user's keras.applications model called on
# the input): the walk reads its own operations in its place.
inner = keras.Input((51, 51, 3))
h = L.ReLU()(L.BatchNormalization()(L.Conv2D(8, 3, padding="same")(inner)))
backbone = keras.Model(inner, h)
inp = keras.Input((51, 51, 3))
nested = keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(backbone(inp))))
executor = timeline.Executor(conv_threads=threads)
out["nested"] = step_peak(nested, x, y, None)
out["nested rule"] = sum(graph_walk.walk_step(nested, b, 4, RematInfo(), executor))
# The same backbone frozen (trainable = False) on 96 px maps: no backward runs in it, its
# BatchNormalization computes as in inference, x * inv + offset, over its input, and so does
# the ReLU: the step's peak is the forward's, one map of 3.4 MiB at a time.
inner = keras.Input((96, 96, 3))
h = L.ReLU()(L.BatchNormalization()(L.Conv2D(32, 1)(inner)))
backbone = keras.Model(inner, h)
backbone.trainable = False
inp = keras.Input((96, 96, 3))
frozen = keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(backbone(inp))))
x96 = tf.random.normal((b, 96, 96, 3))
out["frozen"] = step_peak(frozen, x96, y, None)
out["frozen rule"] = sum(graph_walk.walk_step(frozen, b, 4, RematInfo(), executor))
out["map"] = 96 * 96 * 32 * b * 4
# A siamese pair: one backbone (nested) called on two views of the input, and a Conv2D shared
# by both branches: every call keeps its own tensors, and the shared weights have one gradient.
inner = keras.Input((96, 96, 3))
backbone = keras.Model(inner, L.ReLU()(L.BatchNormalization()(L.Conv2D(32, 1)(inner))))
inp = keras.Input((96, 96, 3))
head = L.Conv2D(16, 1)
views = [head(backbone(v)) for v in (inp, L.Rescaling(0.5)(inp))]
siamese = keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(L.Add()(views))))
out["siamese"] = step_peak(siamese, tf.random.normal((12, 96, 96, 3)), tf.zeros((12,), tf.int32))
out["siamese rule"] = sum(graph_walk.walk_step(siamese, 12, 4, RematInfo(), executor))
# Four Conv2D(32, 3, activation="relu") at 48 px, batch 16: TensorFlow's filter gradient (its
# im2col buffer) runs past the ReLU's short backward, beside the convolution before it.
inp = keras.Input((48, 48, 3))
h = inp
for _ in range(4):
    h = L.Conv2D(32, 3, padding="same", activation="relu")(h)
stack = keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))
out["stack"] = step_peak(
    stack, tf.random.normal((16, 48, 48, 3)), tf.zeros((16,), tf.int32), peak=most_peak)
out["stack rule"] = sum(graph_walk.walk_step(stack, 16, 4, RematInfo(), executor))
print("RESULT " + json.dumps(out))
"""


def test_a_step_computes_only_the_gradients_a_weight_needs_and_holds_them_as_they_come():
    r = onednn_off_result(SCRIPT, timeout=300)
    # Rescaling -> Conv2D(8, 3) at 51 px, batch 3: the filter gradient's buffer (23.3 MiB) is
    # the step; counted with an input gradient's beside it the rule reads 0.504.
    assert 0.85 <= r["rescaled"] / r["rescaled rule"] <= 1.15, r
    assert r["rescaled"] / r["rescaled with input gradient"] < 0.7, r
    # The same convolution under 16 Dense layers (15.1 MiB of weights) with loss scaling: its
    # filter gradient runs last, beside every scaled gradient (38.7 MiB; measured 1.017x in
    # three runs); both copies of every gradient beside that buffer read 0.732.
    assert 0.85 <= r["scaled"] / r["scaled rule"] <= 1.15, r
    assert r["scaled"] / r["scaled beside all"] < 0.8, r
    # A convolution, a BatchNormalization and a ReLU as a backbone nested in the model: 0.977x
    # the walk in two runs (read as one layer, the walk counted 0.33 MiB of it: 71.9x).
    assert 0.85 <= r["nested"] / r["nested rule"] <= 1.15, r
    # Frozen: one 3.4 MiB map at the peak (3.376 MiB measured twice), the walk 0.915x (the
    # convolution's input beside its output); a norm's moments and an output beside its input,
    # as in training, read 0.33x.
    assert r["frozen"] < 1.1 * r["map"], r
    assert 0.85 <= r["frozen"] / r["frozen rule"] <= 1.15, r
    # A siamese pair at 96 px, batch 12 (13.5 MiB maps): each call of the backbone and of the
    # shared head keeps its own tensors, 1.20x and 1.31x the walk; walked at its first call
    # only (as before), 1.81x. What stays above the walk is the executor's: with two inter-op
    # threads it runs the two branches' backwards at once, where the walk runs one op at a
    # time (their order moved the measured peak by 12 MiB between runs).
    assert 0.85 <= r["siamese"] / r["siamese rule"] <= 1.45, r
    # Two filter gradients' im2col buffers (27.8 MiB each) at once: measured 73.8-80.8 MiB in 60
    # calls here, 0.87-0.95x the walk (85.2 MiB); one at a time, as before, 1.48x. Whether the
    # two overlap is the executor's timing: a CI run beside another test read 55.1 MiB (one
    # buffer) in the least of 3 calls. The rule is the bound a run's peak reaches over its steps,
    # so it is held against the most of 6 calls, as a run's peak is the most of its steps.
    assert 0.85 <= r["stack"] / r["stack rule"] <= 1.15, r
