"""Pruning (issue 6): schedules against the formula, exact sparsity, zeros that stay zero,
the 2:4 pattern, which weights are chosen, and what a pruned run records in MLflow."""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from models.spec import DataSpec
from models.transformer import TransformerBlock
from runner import estimate, pruning
from runner.config import ConfigError, PruningConfig, validate
from runner.step import build_optimizer, make_train_step
from runner.train import build_model, run
from tests.conftest import compose_config, tiny_overrides

TOKENS = DataSpec("tokens", (8,), 16, per_token=True, vocab_size=16)
IMAGES = DataSpec("image", (32, 32, 3), 10)
H32 = ["model.h=32", "model.heads=2"]  # kernels of 512+ weights: 0.5% is 2-3 weights


def schedule(**keys):
    return OmegaConf.structured(PruningConfig(**keys))


# Expected values written out from the formulas (Zhu & Gupta 2017, eq. 1; tfmot's schedules).
POLY = dict(
    schedule="polynomial",
    initial_sparsity=0.1,
    target_sparsity=0.8,
    begin_step=100,
    end_step=1100,
    frequency=100,
)
SCHEDULE_VALUES = [
    (POLY, 99, 0.0),  # before begin_step: dense
    (POLY, 100, 0.1),  # s_i at t0
    (POLY, 150, 0.1),  # masks change only at multiples of frequency
    (POLY, 300, 0.8 - 0.7 * 0.8**3),  # (t - t0) / (n dt) = 0.2
    (POLY, 600, 0.8 - 0.7 * 0.5**3),  # halfway: 0.7125
    (POLY, 699, 0.8 - 0.7 * 0.5**3),
    (POLY, 1100, 0.8),  # s_f at end_step, and after it
    (POLY, 5000, 0.8),
    # end_step null in a 200-step run: the last step is 199, also a mask update
    (dict(schedule="polynomial", target_sparsity=0.5), 100, 0.5 * (1 - (99 / 199) ** 3)),
    (dict(schedule="polynomial", target_sparsity=0.5), 199, 0.5),
    (dict(schedule="constant", target_sparsity=0.6, begin_step=10), 9, 0.0),
    (dict(schedule="constant", target_sparsity=0.6, begin_step=10), 10, 0.6),
    (dict(schedule="constant", target_sparsity=0.6, begin_step=10), 157, 0.6),
    (dict(schedule="m_by_n", m=2, n=4), 0, 0.5),
    (dict(schedule="m_by_n", m=1, n=4), 0, 0.75),
    (dict(schedule="none"), 50, 0.0),
]


@pytest.mark.parametrize(("keys", "step", "expected"), SCHEDULE_VALUES)
def test_schedule_values_follow_the_formula(keys, step, expected):
    assert pruning.sparsity_at(schedule(**keys), step, 200) == pytest.approx(expected)


def test_update_steps_are_frequency_multiples_and_end_step():
    p = schedule(schedule="polynomial", begin_step=10, frequency=50)
    updates = [t for t in range(200) if pruning.is_update_step(p, t, 200)]
    assert updates == [10, 60, 110, 160, 199]


BAD_PRUNING = [
    (["pruning.schedule=magnitude"], "pruning.schedule=magnitude", "m_by_n"),
    (["pruning.target_sparsity=1.0"], "pruning.target_sparsity=1.0", "[0, 1)"),
    (["pruning.initial_sparsity=-0.1"], "pruning.initial_sparsity=-0.1", "[0, 1)"),
    (["pruning.frequency=0"], "pruning.frequency=0", ">= 1"),
    (["pruning=m_by_n", "pruning.m=4"], "pruning.n=4", "pruning.m=4"),
    (["pruning.begin_step=50", "pruning.end_step=10"], "pruning.end_step=10", ">= begin_step"),
    (["pruning.begin_step=200"], "pruning.begin_step=200", "<= 199"),
    (["pruning.include=['mlp_(']"], "pruning.include=mlp_(", "regular expressions"),
]


@pytest.mark.parametrize(("overrides", "message", "allowed"), BAD_PRUNING)
def test_bad_pruning_config_fails_in_one_line(overrides, message, allowed):
    cfg = compose_config(["pruning=constant", *overrides])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).startswith(message) and allowed in str(err.value)


def test_magnitude_mask_zeros_exactly_the_smallest():
    weights = np.random.default_rng(0).normal(size=(37, 11))
    mask = pruning.magnitude_mask(weights, 0.3)
    assert (mask == 0).sum() == round(0.3 * weights.size)
    assert np.abs(weights[mask == 0]).max() < np.abs(weights[mask == 1]).min()


def groups_of(weights, axes, n):
    """Every group of n consecutive weights along `axes`, as rows."""
    perm = [a for a in range(weights.ndim) if a not in axes] + list(axes)
    return np.transpose(weights, perm).reshape(-1, n)


@pytest.mark.parametrize(
    ("shape", "axes"),
    [((16, 8), (0,)), ((3, 3, 8, 4), (2,)), ((16, 2, 8), (0,)), ((2, 8, 16), (0, 1))],
    ids=["dense", "conv2d", "attention_qkv", "attention_output"],
)
def test_m_by_n_mask_keeps_the_largest_two_of_four(shape, axes):
    weights = np.random.default_rng(1).normal(size=shape)
    mask = pruning.m_by_n_mask(weights, axes, 2, 4)
    kept, magnitudes = groups_of(mask, axes, 4), groups_of(np.abs(weights), axes, 4)
    assert (kept.sum(axis=1) == 2).all()
    smallest_kept = np.where(kept == 1, magnitudes, np.inf).min(axis=1)
    largest_dropped = np.where(kept == 0, magnitudes, -np.inf).max(axis=1)
    assert (smallest_kept > largest_dropped).all()


def paths(variables):
    return sorted(v.path for v in variables)


def test_default_selection_skips_embeddings_biases_norms():
    keras.backend.clear_session()
    cfg = compose_config(tiny_overrides("transformer") + ["pruning=constant"])
    model = build_model(cfg, TOKENS)
    projections = ["attention_output", "key", "query", "value"]
    assert paths(pruning.select_kernels(model, cfg)) == sorted(
        [f"block_0/attn/{p}/kernel" for p in projections]
        + ["block_0/mlp_down/kernel", "block_0/mlp_up/kernel", "logits/kernel"]
    )
    cfg.pruning.include, cfg.pruning.exclude = ["mlp_"], ["bias", "norm"]
    assert paths(pruning.select_kernels(model, cfg)) == [
        "block_0/mlp_down/kernel",
        "block_0/mlp_up/kernel",
    ]


def test_first_conv_and_batchnorm_are_skipped_and_estimate_agrees():
    keras.backend.clear_session()
    cfg = compose_config(tiny_overrides("mobilenet") + ["pruning=constant"])
    model = build_model(cfg, IMAGES)
    chosen = pruning.select_kernels(model, cfg)
    assert "Conv1/kernel" not in paths(chosen)  # MobileNetV2's first conv
    assert "expanded_conv_depthwise/kernel" in paths(chosen)
    assert all(v.path.endswith("kernel") for v in chosen)
    optimizer = build_optimizer(cfg)
    optimizer.build(model.trainable_variables)
    masks = estimate.estimate_memory(model, optimizer, cfg, IMAGES)["masks"]
    assert masks == sum(4 * v.numpy().size for v in chosen)


@pytest.mark.parametrize(
    ("optimizer", "accum"), [("adam", 1), ("sgd", 2)], ids=["adam", "sgd_momentum_accum2"]
)
def test_zeros_stay_zero_across_steps(optimizer, accum):
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    extra = [f"trainer.optimizer={optimizer}", "trainer.lr=0.05", f"accum={accum}"]
    cfg = compose_config(tiny_overrides("transformer") + ["pruning=constant", *extra])
    model = build_model(cfg, TOKENS)
    opt = build_optimizer(cfg)
    pruner = pruning.Pruner(model, cfg, total_steps=10)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = make_train_step(model, opt, loss_fn, accum, False, pruner.apply_masks)
    free = make_train_step(model, opt, loss_fn, accum, False)  # control: no masking
    xs = tf.random.uniform((accum, 4, 8), 0, 16, tf.int32)
    pruner.update_masks(0)  # step 0: first mask update; masks hold from here on
    pruned = [m.numpy() == 0 for m in pruner.masks]
    before = [k.numpy().copy() for k in pruner.kernels]
    for _ in range(5):  # momentum and Adam's moments keep pushing the pruned weights
        step(zip(xs, xs, strict=True))
        for kernel, zero in zip(pruner.kernels, pruned, strict=True):
            assert (kernel.numpy()[zero] == 0).all()
    for kernel, start, zero in zip(pruner.kernels, before, pruned, strict=True):
        assert (kernel.numpy() != start)[~zero].mean() > 0.5  # the kept weights trained
    free(zip(xs, xs, strict=True))
    assert any((k.numpy()[z] != 0).any() for k, z in zip(pruner.kernels, pruned, strict=True))


def pruned_model(client, run_id, policy="float32"):
    """The pruned model artifact, loaded under the run's policy: TransformerBlock builds its
    sublayers with the global policy, so a mixed-precision model loads only under its own."""
    path = client.download_artifacts(run_id, "pruned_model.keras")
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        return keras.saving.load_model(path, custom_objects={"TransformerBlock": TransformerBlock})
    finally:
        keras.config.set_dtype_policy(previous)


def test_pruned_run_is_exact_and_recorded_beside_its_dense_baseline(tiny_cfg, store):
    job = [*H32, "trainer.max_steps=6", "trainer.jit_compile=false"]  # XLA: the test below
    dense = run(tiny_cfg("transformer", *job))
    cfg = tiny_cfg("transformer", *job, "pruning=constant")
    cfg.pruning.target_sparsity = 0.7
    result = run(cfg)
    client = MlflowClient(tracking_uri=store)
    mlrun = client.get_run(result["run_id"])
    metrics = mlrun.data.metrics
    assert metrics["prune/sparsity"] == pytest.approx(0.7, abs=0.005)
    assert metrics["prune/gzip_ratio"] > 1.0
    assert metrics["prune/dense_val_accuracy"] == dense["val/accuracy"]
    assert mlrun.data.tags["prune/dense_run_id"] == dense["run_id"]
    assert metrics["mem/estimate/masks_bytes"] > 0
    table = client.download_artifacts(result["run_id"], "pruning_table.csv")
    with open(table) as f:
        rows = {row["path"]: row for row in csv.DictReader(f)}
    model = pruned_model(client, result["run_id"])
    kernels = [v for v in model.trainable_variables if v.path in rows]
    assert len(kernels) == len(rows) == 7
    for kernel in kernels:  # each kernel on its own, read back from the saved model
        weights = kernel.numpy()
        assert (weights == 0).mean() == pytest.approx(0.7, abs=0.005), kernel.path
        assert int(rows[kernel.path]["zeros"]) == (weights == 0).sum()


def test_two_of_four_holds_after_a_run_with_every_other_technique(tiny_cfg, store):
    extra = ["pruning=m_by_n", "accum=2", "precision=mixed", "checkpointing=blocks"]
    result = run(tiny_cfg("transformer", *H32, *extra))
    assert result["prune/sparsity"] == pytest.approx(0.5)
    client = MlflowClient(tracking_uri=store)
    model = pruned_model(client, result["run_id"], "mixed_float16")
    pruner = pruning.Pruner(model, compose_config(["pruning=m_by_n"]), total_steps=3)
    assert len(pruner.kernels) == 7
    for kernel, axes in zip(pruner.kernels, pruner.axes, strict=True):
        nonzero = groups_of(kernel.numpy() != 0, axes, 4).sum(axis=1)
        assert (nonzero <= 2).all(), kernel.path


@pytest.mark.slow
def test_half_pruned_digits_model_keeps_its_accuracy(store):
    """A 2-layer h=64 transformer on data=digits, 300 steps, same seed: gradual pruning to 50%
    (Zhu & Gupta, done by step 200, then 100 steps with fixed masks) against dense training."""
    base = [
        "data=digits",
        "model.h=64",
        "model.layers=2",
        "model.heads=4",
        "trainer.max_steps=300",
        "trainer.lr=0.002",
        "trainer.progress=false",
        f"mlflow.tracking_uri={store}",
    ]
    dense = run(compose_config(base))
    pruned = run(
        compose_config(
            base + ["pruning=polynomial", "pruning.frequency=20", "pruning.end_step=200"]
        )
    )
    print(f"val/accuracy dense {dense['val/accuracy']:.4f} pruned {pruned['val/accuracy']:.4f}")
    assert dense["val/accuracy"] > 0.85
    assert pruned["prune/sparsity"] == pytest.approx(0.5, abs=0.005)
    assert pruned["val/accuracy"] >= dense["val/accuracy"] - 0.03
    assert pruned["prune/dense_val_accuracy"] == dense["val/accuracy"]
