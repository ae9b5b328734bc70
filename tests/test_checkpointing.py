"""Gradient checkpointing: same gradients, same weights (BatchNorm statistics included),
same parameters, for every model family; every policy composes and trains."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from models.efficientnet import build_efficientnet
from models.mobilenet import build_mobilenet
from models.spec import DataSpec
from models.transformer import build_transformer
from runner.measure import flops
from runner.techniques import checkpointing
from runner.techniques.accumulation import make_train_step
from runner.train import run

TOKENS = DataSpec("tokens", (8,), 16, per_token=True, vocab_size=16)
IMAGES = DataSpec("image", (32, 32, 3), 10)
BUILDERS = {
    "transformer": (
        lambda: build_transformer(TOKENS, h=16, layers=4, heads=2, dropout=0.1),
        TOKENS,
    ),
    "mobilenet": (lambda: build_mobilenet(IMAGES, alpha=0.35), IMAGES),
    "efficientnet": (lambda: build_efficientnet(IMAGES), IMAGES),
}
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _batch(spec: DataSpec, n: int = 4):
    rng = np.random.default_rng(0)
    if spec.kind == "tokens":
        return (
            tf.constant(rng.integers(0, 16, (n, 8)), tf.int32),
            tf.constant(rng.integers(0, 16, (n, 8)), tf.int32),
        )
    return (
        tf.constant(rng.normal(size=(n, 32, 32, 3)), tf.float32),
        tf.constant(rng.integers(0, 10, n), tf.int32),
    )


def _fresh(family: str, policy: str):
    """The same initial weights (seeded build) with and without checkpointing."""
    build, spec = BUILDERS[family]
    keras.backend.clear_session()  # the same variable paths in every build
    keras.utils.set_random_seed(0)
    base = build()
    model, info = checkpointing.apply(base, policy, every=2)
    return base, model, info, spec


def _gradients(model, x, y, jit: bool):
    @tf.function(jit_compile=jit)
    def grads():
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    keras.utils.set_random_seed(1)  # the same dropout masks in both runs
    return [tf.convert_to_tensor(g).numpy() for g in grads()]


def _by_path(variables):
    return {v.path: v.numpy() for v in variables}


@pytest.mark.parametrize("family", ["transformer", "mobilenet", "efficientnet"])
def test_gradients_equal_and_state_updated_once(family):
    # One reference (no checkpointing) per family, against which both policies are checked.
    base, _, _, spec = _fresh(family, "none")
    x, y = _batch(spec)
    expected = dict(
        zip(
            [v.path for v in base.trainable_variables],
            _gradients(base, x, y, jit=False),
            strict=True,
        )
    )
    expected_state = _by_path(base.non_trainable_variables)
    params = base.count_params()
    for policy in ("blocks", "selective"):
        _, remat, info, _ = _fresh(family, policy)
        assert info.segments >= 4 and remat.count_params() == params, policy
        got = dict(
            zip(
                [v.path for v in remat.trainable_variables],
                _gradients(remat, x, y, jit=False),
                strict=True,
            )
        )
        assert got.keys() == expected.keys(), policy
        for path, grad in expected.items():
            np.testing.assert_allclose(
                got[path], grad, rtol=1e-5, atol=1e-6, err_msg=f"{policy} {path}"
            )
        # BatchNorm moving statistics (and dropout seeds) advanced once, as without
        # checkpointing.
        state = _by_path(remat.non_trainable_variables)
        for path, value in expected_state.items():
            np.testing.assert_allclose(
                state[path], value, rtol=1e-5, atol=1e-6, err_msg=f"{policy} {path}"
            )


def _trained(family: str, policy: str) -> dict:
    """Every variable after 3 optimizer steps of 2 accumulated micro-batches (XLA for the
    transformer)."""
    _, model, _, spec = _fresh(family, policy)
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    optimizer.build(model.trainable_variables)
    step = make_train_step(model, optimizer, LOSS, accum=2, jit_compile=(family == "transformer"))
    x, y = _batch(spec, 8)
    xs, ys = tf.reshape(x, (2, 4, *x.shape[1:])), tf.reshape(y, (2, 4, *y.shape[1:]))
    keras.utils.set_random_seed(1)
    for _ in range(3):
        step(zip(xs, ys, strict=True))
    return _by_path(model.variables)


# One policy a family: the gradients of each (test_gradients_equal_and_state_updated_once)
# are checked apart; here, what 3 optimizer steps of accumulated micro-batches make of them:
# the attention core recomputed under XLA, and MobileNetV2's longer segments (sqrt). A
# MobileNetV2 build and trace is about 12 s of the suite.
@pytest.mark.parametrize(
    ("family", "policy"), [("transformer", "selective"), ("mobilenet", "sqrt")]
)
def test_weights_match_after_steps_with_accum_and_xla(family, policy):
    expected = _trained(family, "none")
    got = _trained(family, policy)
    for path, value in expected.items():
        np.testing.assert_allclose(
            got[path], value, rtol=1e-4, atol=1e-5, err_msg=f"{policy} {path}"
        )


@pytest.mark.parametrize(
    ("policy", "blocks", "segments"), [("blocks", 4, 4), ("sqrt", 4, 2), ("every", 4, 2)]
)
def test_segment_counts(policy, blocks, segments):
    _, _, info, _ = _fresh("transformer", policy)
    assert (info.blocks, info.segments) == (blocks, segments)


def test_mobilenet_v2_blocks_are_its_17_inverted_residuals():
    _, _, info, _ = _fresh("mobilenet", "blocks")
    assert info.blocks == 17 and info.segment_outputs[-1] == "block_16_project_BN"


def test_unsegmentable_model_is_a_clear_error():
    # Two inputs that never meet: no point where a single tensor is live, so no block.
    a, b = keras.Input((4,)), keras.Input((4,))
    model = keras.Model([a, b], [keras.layers.Dense(2)(a), keras.layers.Dense(2)(b)])
    with pytest.raises(ValueError, match="checkpointing=blocks: .*no single-tensor block"):
        checkpointing.apply(model, "blocks", 2)
    # Dense -> Dense has no block names but two blocks by structure (graph_cuts); nothing
    # for selective to recompute.
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(3)(inputs)))
    assert checkpointing.apply(model, "blocks", 2)[1].segments == 2
    with pytest.raises(ValueError, match="checkpointing=selective: .*neither attention"):
        checkpointing.apply(model, "selective", 2)


def test_selective_keeps_the_convolutions_and_recomputes_what_lies_between():
    base, _, info, _ = _fresh("mobilenet", "selective")
    recomputed = set().union(*info.segment_ops)
    # Block 1: expand conv, BN, ReLU6, pad, depthwise, BN, ReLU6, project conv.
    assert {"block_1_expand_BN", "block_1_depthwise", "block_1_depthwise_relu"} <= recomputed
    assert not any("expand" == n.split("_")[-1] or n.endswith("project") for n in recomputed)
    assert "block_1_expand" in info.segment_inputs
    assert flops.recomputed_flops(base, info) > 0


def test_a_policy_that_cannot_save_says_so_before_training(tiny_cfg, capsys):
    from mlflow.tracking import MlflowClient

    cfg = tiny_cfg("transformer", "checkpointing=blocks")  # the tiny transformer: 1 layer
    result = run(cfg)
    out = capsys.readouterr().out
    # before the first step: ahead of the summary's peak/step-time line
    assert out.index("checkpointing=blocks saves little memory here") < out.index(" step ")
    tags = MlflowClient(cfg.mlflow.tracking_uri).get_run(result["run_id"]).data.tags
    assert "1 block(s) form one segment" in tags["remat/warning"]
    # With 2 layers blocks does save, and the run stays quiet: the runs below.


@pytest.mark.parametrize(
    "precision, policy", [("fp32", "blocks"), ("mixed", "selective"), ("bf16", "blocks")]
)
def test_checkpointed_run_under_each_precision(precision, policy, tiny_cfg, capsys):
    result = run(
        tiny_cfg(
            "transformer",
            "model.layers=2",
            f"checkpointing={policy}",
            f"precision={precision}",
            "accum=2",
        )
    )
    assert result["remat/segments"] == 2
    assert "saves little memory" not in capsys.readouterr().out
    assert result["speed/hardware_flops_per_step"] > result["speed/flops_per_step"]
    assert result["mem/estimate/activations_bytes"] > 0


# One process for the three families, BFC allocator on before TensorFlow loads: the
# forward+backward peak over the bytes held before the step, for `none` and each policy, at
# sizes where activations dominate (the tiny sizes above hold more weights than activations).
# The allocator's pool is grown once at the start, so that every step's peak is what its
# tensors need, whatever the family before it left in the pool.
PEAKS_SCRIPT = """
import json, os, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import keras, tensorflow as tf
from models.spec import DataSpec
from models.transformer import build_transformer
from models.mobilenet import build_mobilenet
from models.efficientnet import build_efficientnet
from runner.measure.telemetry import Memory
from runner.techniques import checkpointing

builders = {
    "transformer": (lambda s: build_transformer(s, h=16, layers=4, heads=2, dropout=0.1),
                    DataSpec("tokens", (128,), 16, per_token=True, vocab_size=16)),
    "mobilenet": (lambda s: build_mobilenet(s, alpha=0.35), DataSpec("image", (96, 96, 3), 10)),
    "efficientnet": (build_efficientnet, DataSpec("image", (64, 64, 3), 10)),
}
memory = Memory("/CPU:0")
memory.grow_pool()
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
peaks = {}
for family, policies in json.loads(sys.argv[1]).items():
    build, spec = builders[family]
    if spec.kind == "tokens":
        x = tf.random.uniform((8, 128), 0, 16, tf.int32)
        y = tf.random.uniform((8, 128), 0, 16, tf.int32)
    else:
        x = tf.random.normal((8, *spec.input_shape))
        y = tf.random.uniform((8,), 0, 10, tf.int32)
    peaks[family] = {}
    for policy in ("none", *policies):
        keras.backend.clear_session()
        model, info = checkpointing.apply(build(spec), policy, 2)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            return tape.gradient(value, model.trainable_variables)

        step()
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        grads = step()
        peaks[family][policy] = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
        del grads, step, model
print(json.dumps(peaks))
"""


PEAK_POLICIES = {
    # sqrt and every group the same block boundaries as blocks into longer segments (their
    # counts: test_segment_counts), through the same Remat: every's peak is measured, sqrt's
    # is every's grouping at another length. A CNN's block boundaries (blocks) and chains
    # (selective) on MobileNetV2; EfficientNet's go through the same Remat (their gradients:
    # test_gradients_equal_and_state_updated_once). A CNN's build and trace here is about 12 s
    # of the suite.
    "transformer": ("blocks", "every", "selective"),
    "mobilenet": ("blocks", "selective"),
}


@pytest.mark.slow
def test_every_policy_lowers_the_measured_peak():
    # Gradient equality alone would pass a Remat that skipped recomputation; the allocator's
    # peak does not. One fresh process for every family (TensorFlow's import is most of a
    # process's cost), each policy against `none` of its own family.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-c", PEAKS_SCRIPT, json.dumps(PEAK_POLICIES)],
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(peaks) == set(PEAK_POLICIES)
    for family, policies in PEAK_POLICIES.items():
        assert set(peaks[family]) == {"none", *policies}, family
        for policy in policies:
            assert peaks[family][policy] < 0.9 * peaks[family]["none"], (family, policy, peaks)
