"""pruning=structured (runner/techniques/structured.py, runner/train/removal.py): whole channels
masked on the schedule's clock, the model rebuilt without them after end_step, and the run
going on in the smaller model, across a kill and a resume too."""

import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import keras
import mlflow
import numpy as np
import pytest
import tensorflow as tf
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from models.transformer import TransformerBlock
from runner.config import compose_config, takes_images
from runner.core.errors import ConfigError, ModelError
from runner.feed.pipelines import build_data
from runner.techniques.structured import ChannelPruner
from runner.train import run
from runner.train.job import build_model
from tests.conftest import REPO, run_cli, tiny_overrides
from tests.test_channels import _couplings, _randomized
from tests.test_resume import _start, final_state

RNG = np.random.default_rng(51)


def _pruner(model, total_steps: int = 6, **keys) -> ChannelPruner:
    p = {"schedule": "structured", "begin_step": 0, "end_step": 4, "frequency": 2}
    p |= {"include": [], "exclude": [], **keys}
    return ChannelPruner(model, OmegaConf.create(p), total_steps)


def _adam(model):
    adam = keras.optimizers.Adam()
    adam.build(model.trainable_variables)
    return adam


def _removed_equals_masked(model, x):
    """Half of each group masked at steps 2 and 4, then removed: the smaller model's outputs
    equal the masked model's to 1e-5. Returns (the smaller model, the pruner)."""
    pruner = _pruner(model)
    pruner.choose(2)
    pruner.choose(4)
    masked = np.asarray(model(x, training=False))
    small, _ = pruner.remove(_adam(model))
    np.testing.assert_allclose(small(x, training=False), masked, atol=1e-5, rtol=0)
    return small, pruner


def test_the_masks_take_whole_channels_and_the_removed_model_equals_the_masked_one():
    """Choices at steps 2 and 4 on the polynomial ramp (0.4375, then 0.5 of each group); the
    rebuilt model computes what the masked large model computes (a wrong slice of any weight
    along any group's axis shows here), with fewer parameters."""
    model = _randomized(_couplings())
    x = RNG.normal(size=(2, 12, 12, 3)).astype("float32")
    dense = np.asarray(model(x, training=False))
    pruner = _pruner(model)
    assert [pruner.choose(t) for t in (2, 3, 4)] == [True, False, True]
    assert pruner.choices == [(2, pytest.approx(0.4375)), (4, 0.5)]
    masked = np.asarray(model(x, training=False))
    assert np.abs(masked - dense).max() > 1e-3  # the masks changed what it computes
    small, carried = pruner.remove(_adam(model))
    np.testing.assert_allclose(small(x, training=False), masked, atol=1e-5, rtol=0)
    assert small.count_params() < 0.6 * model.count_params()
    assert len(carried.variables) == len(_adam(small).variables)
    for g, k in pruner.kept.items():  # half of each, in multiples of 8; 8 or fewer: all
        size = pruner.analysis.groups[g].size
        assert len(k) == (size if size <= 8 else max(8, 8 * (size // 2 // 8))), size
    assert any(len(k) < pruner.analysis.groups[g].size for g, k in pruner.kept.items())


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=mobilenet", "model.version=v2"],
        ["model=mobilenet", "model.version=v3_small"],
        ["model=mobilenet", "model.version=v3_large"],
        ["model=efficientnet"],  # squeeze-and-excitation in every block
        ["model=transformer", "model.h=32", "model.heads=4", "data.seq_len=8"],
    ],
    ids=["mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet", "transformer"],
)
def test_every_shipped_model_as_built_loses_channels_exactly(overrides):
    """Each shipped model as the run builds it (its logits layer, its input's preprocessing):
    half of each group masked, then removed; the outputs agree to 1e-5."""
    cfg = compose_config([*overrides, "data.image_size=32", "data.batch_size=4"])
    spec = build_data(cfg, takes_images(cfg)).spec
    model = _randomized(build_model(cfg.model, spec))
    x = (
        RNG.integers(0, spec.vocab_size, size=(2, spec.seq_len))
        if spec.kind == "tokens"
        else RNG.uniform(-1, 1, size=(2, *spec.input_shape)).astype("float32")
    )
    small, pruner = _removed_equals_masked(model, x)
    assert small.count_params() < 0.7 * model.count_params()
    assert pruner.untouched == {}


def test_at_fraction_zero_the_rebuilt_model_is_the_model():
    model = _randomized(_couplings())
    x = RNG.normal(size=(2, 12, 12, 3)).astype("float32")
    pruner = _pruner(model, target_fraction=0.0)
    pruner.choose(2)
    pruner.choose(4)
    small, _ = pruner.remove(_adam(model))
    assert small.count_params() == model.count_params()
    np.testing.assert_allclose(small(x, training=False), model(x, training=False), atol=1e-6)


def test_taylor_keeps_the_channels_whose_weights_move_the_loss_not_the_largest():
    """Dense(16) units 0-7 have large weights and no gradient, units 8-15 small weights and a
    gradient: l1 keeps 0-7, taylor (|w x g| summed over the steps' updates, along the unit's
    axis of each weight its group indexes) keeps 8-15. A taylor sum along the wrong axis, or
    one that is not added, keeps what l1 keeps."""
    kept = {}
    for importance in ("l1", "taylor"):
        x = keras.Input((6,))
        model = keras.Model(x, keras.layers.Dense(3)(keras.layers.Dense(16, name="d")(x)))
        kernel = np.full((6, 16), 0.1, "float32")
        kernel[:, :8] = 1.0
        model.get_layer("d").kernel.assign(kernel)
        pruner = _pruner(model, importance=importance)
        grads = [np.zeros(v.shape, "float32") for v in model.trainable_variables]
        grads[0][:, 8:] = 1.0  # the first Dense's kernel: only units 8-15 move the loss
        for _ in range(2):  # two steps' updates, summed
            pruner.after_update([tf.constant(g) for g in grads], model.trainable_variables)
        assert pruner.choose(4)
        (kept[importance],) = (k for g, k in pruner.kept.items() if len(k) < 16)
    assert kept == {"l1": pytest.approx(range(8)), "taylor": pytest.approx(range(8, 16))}


def test_include_chooses_groups_by_their_layers_and_a_subclassed_model_is_refused():
    model = _couplings()
    only = _pruner(model, include=["^a$"])
    assert [model_made for g in only.groups for model_made in only.analysis.groups[g].made_by]
    assert all("a" in only.analysis.groups[g].made_by for g in only.groups)
    with pytest.raises(ConfigError) as err:
        _pruner(model, include=["^nothing$"])
    assert str(err.value).startswith("pruning.include=['^nothing$']")

    class Own(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    own = Own()
    own(np.zeros((1, 3), "float32"))
    with pytest.raises(ConfigError) as err:
        _pruner(own)
    assert "a subclassed model" in str(err.value)


def test_a_users_unet_loses_channels_through_its_concatenations_exactly():
    """examples/my_models.py's U-Net: skip connections concatenate an encoder's channels
    behind the upsampled middle's, so each keeps its own offsets in the decoder's input."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from my_models import unet
    finally:
        sys.path.remove(str(REPO / "examples"))
    spec = SimpleNamespace(kind="image", input_shape=(16, 16, 3), num_classes=5)
    model = _randomized(unet(spec, filters=16, blocks=2))
    x = RNG.normal(size=(2, 16, 16, 3)).astype("float32")
    small, _ = _removed_equals_masked(model, x)
    assert small.count_params() < 0.4 * model.count_params()


class _Scaled(keras.layers.Layer):
    """Applies a function its config cannot hold: Keras cannot make it again from its config."""

    def __init__(self, fn, **kwargs):
        super().__init__(**kwargs)
        self.fn = fn

    def call(self, x):
        return self.fn(x)


def cannot_be_rebuilt(spec):
    """A model of one's own whose rebuild fails (tests/test_structured.py)."""
    x = keras.Input(spec.input_shape)
    y = keras.layers.Conv2D(16, 3, activation="relu", name="free")(x)
    y = _Scaled(lambda t: 2.0 * t)(keras.layers.Conv2D(8, 3, name="scaled")(y))
    y = keras.layers.GlobalAveragePooling2D()(y)
    return keras.Model(x, keras.layers.Dense(spec.num_classes)(y))


def test_a_removal_that_fails_fails_the_run_in_one_line_and_keeps_its_checkpoints(tmp_path, store):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "odd.yaml").write_text(
        "_target_: tests.test_structured.cannot_be_rebuilt\n"
    )
    cfg = compose_config(
        [f"mlflow.tracking_uri={store}", "model=odd", "data.image_size=16"]
        + ["data.batch_size=4", "data.train_samples=16", "data.val_samples=4"]
        + ["trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.progress=false"]
        + ["pruning=structured", "pruning.frequency=2", "pruning.end_step=4"],
        tmp_path,
    )
    with pytest.raises(ModelError) as err:
        run(cfg)
    said = str(err.value)
    assert said.startswith("pruning=structured: the model could not be rebuilt without its ")
    assert "after optimizer step 4" in said and "\n" not in said
    client = MlflowClient(store)
    (failed,) = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
    assert failed.info.status == "FAILED"
    checkpoints = Path(failed.data.tags["run_dir"]) / "checkpoints"
    assert tf.train.latest_checkpoint(str(checkpoints)).endswith("ckpt-2")


def _val_loss(model, cfg) -> float:
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    total = count = 0.0
    for x, y in build_data(cfg, False).val:
        total += float(loss_fn(y, model(x, training=False))) * np.size(y)
        count += np.size(y)
    return total / count


# The tiny transformer (tests/conftest.py) with 4 heads of 8 and 128 MLP units: 50% of them
# leaves whole heads (round_to 8 = one head) and 64 units.
JOB = ["model.h=32", "model.heads=4", "data.train_samples=64"]


def test_a_structured_run_trains_keeps_and_reports_the_smaller_model(tiny_cfg, store, capsys):
    """taylor importance through the compiled step; after the removal at step 8 the run's
    figures, its estimate and its kept model are the smaller model's, whose validation loss
    is the run's; before and after are logged apart."""
    cfg = tiny_cfg(
        "transformer", *JOB, "trainer.max_steps=12", "trainer.save_model=true",
        "pruning=structured", "pruning.importance=taylor", "pruning.frequency=3",
        "pruning.end_step=8",
    )  # fmt: skip
    result = run(cfg)
    out = capsys.readouterr().out
    client = MlflowClient(store)
    mlrun = client.get_run(result["run_id"])
    m = mlrun.data.metrics
    assert "removed 50% of 2 channel groups at step 8: params 0." in out
    assert m["prune/groups_reduced"] == 2  # heads 4 -> 2, MLP units 128 -> 64
    # Per layer 12h^2 + 13h at full width. Half the heads: the q, k, v and output kernels lose
    # 2h^2 and the q, k, v biases 3h/2; half the MLP's 4h units: 4h^2 weights and 2h biases.
    h = 32
    assert m["prune/params_before"] - m["prune/params_after"] == 6 * h * h + 3.5 * h
    assert m["prune/params_after"] == m["params/total"]
    assert m["prune/flops_ratio"] < 0.8 and m["prune/fine_tune_steps"] == 4
    assert m["prune/before/steps"] == 8 and m["prune/after/steps"] == 4
    assert m["mem/estimate/masks_bytes"] == 0
    assert mlrun.data.tags["prune/untouched"] == "none"
    # The large model's variables are freed at the removal (runner/train/compiled.py): what
    # stays allocated between steps falls by at least the removed weights and their two Adam
    # slots, 3 x 4 bytes each (110,080 bytes measured, the masks too; 29,952 and 44,032 while
    # the model's build-time custom gradients held its weights; 500 KB more with no cleanup).
    resting = {
        x.step: x.value for x in client.get_metric_history(mlrun.info.run_id, "mem/current_bytes")
    }
    removed = m["prune/params_before"] - m["prune/params_after"]
    assert resting[8] - resting[12] >= 12 * removed, (resting[8] - resting[12], 12 * removed)
    choices = client.get_metric_history(result["run_id"], "prune/scheduled_fraction")
    assert [x.step for x in choices] == [3, 6, 8]
    mlflow.set_tracking_uri(store)
    try:
        kept = mlflow.keras.load_model(
            f"runs:/{result['run_id']}/model", custom_objects={"TransformerBlock": TransformerBlock}
        )
    finally:
        mlflow.set_tracking_uri(None)
    assert kept.count_params() == m["prune/params_after"]
    assert _val_loss(kept, cfg) == pytest.approx(result["val/loss"], rel=1e-6, abs=1e-6)


@pytest.mark.slow
def test_a_run_killed_after_its_removal_resumes_into_the_smaller_model(tmp_path, store):
    """Killed once a checkpoint after the removal (step 9) is written, the run resumes from it
    into the smaller model and ends bitwise equal to the same job run whole, with accumulation,
    float16 loss scaling and checkpointing rebuilt around the smaller model."""
    job = [
        *tiny_overrides("transformer", store),
        *JOB,
        "trainer.max_steps=150",  # about 2 s of steps after the checkpoint the kill waits for
        "trainer.checkpoint_every=3",
        "trainer.deterministic=true",
        "model.dropout=0.1",  # the dropout seed generators' states must be restored too
        "pruning=structured",
        "pruning.frequency=3",
        "pruning.end_step=9",
        # rebuilt across the removal: the accumulating step, the loss-scaled optimizer's state
        # and checkpointing's wrapper
        "accum=2",
        "precision=mixed",
        "checkpointing=every",
    ]
    killed_dir, whole_dir = tmp_path / "killed", tmp_path / "whole"
    killed = _start([*job, f"hydra.run.dir={killed_dir}"], tmp_path)
    whole = _start([*job, f"hydra.run.dir={whole_dir}"], tmp_path)  # beside it: 2 cores
    index = killed_dir / "checkpoints" / "checkpoint"
    deadline = time.monotonic() + 300
    while killed.poll() is None and time.monotonic() < deadline:
        if index.exists() and '"ckpt-12"' in index.read_text():
            break
        time.sleep(0.005)
    killed.kill()
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert (killed_dir / "channels_removed.json").exists()
    assert whole.wait(timeout=600) == 0, whole.stderr.read()[-3000:]
    resumed = run_cli([f"trainer.resume={killed_dir}"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = int(resumed.stdout.split("resumed after optimizer step ")[1].split()[0])
    assert start >= 12
    expected, got = final_state(whole_dir), final_state(killed_dir)
    assert expected.keys() == got.keys() and len(got) > 10
    different = [n for n in expected if not np.array_equal(expected[n], got[n])]
    assert not different, different
    client = MlflowClient(store)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("tfmemlab").experiment_id],
        f"tags.resumed_from_step = '{start}'",
    )
    assert run.data.metrics["prune/params_ratio"] < 0.8  # from the marker the removal wrote
