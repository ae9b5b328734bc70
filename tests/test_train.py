"""End to end through run(cfg): real TensorFlow, real Hydra config, a real SQLite MLflow store."""

import keras
import pytest
from mlflow.tracking import MlflowClient

from runner.config import compose_config
from runner.train import run
from tests.test_telemetry import check_contract


def _run_and_fetch(cfg, store):
    result = run(cfg)
    client = MlflowClient(tracking_uri=store)
    return result, client, client.get_run(result["run_id"])


@pytest.mark.parametrize("model", ["transformer", "mobilenet", "efficientnet"])
def test_each_family_trains_and_is_recorded(model, tiny_cfg, store, capsys):
    result, client, mlrun = _run_and_fetch(tiny_cfg(model, "accum=2"), store)
    assert mlrun.info.status == "FINISHED"
    params = mlrun.data.params
    assert params["model.name"] == model and params["accum"] == "2"
    assert params["effective_batch_size"] == "8" and params["replicas"] == "1"
    # BatchNorm models are told their statistics follow micro-batches, not the effective batch.
    assert ("BatchNorm" in capsys.readouterr().err) == (model != "transformer")
    assert int(params["params_total"]) == result["params/total"] > 0
    history = client.get_metric_history(mlrun.info.run_id, "train/loss")
    # Once per optimizer step, not per micro-batch (which would log 6 times).
    assert [m.step for m in history] == [1, 2, 3]
    metrics = mlrun.data.metrics
    assert 0.0 <= metrics["val/accuracy"] <= 1.0 and metrics["val/loss"] > 0
    assert metrics["params/trainable"] > 0
    tags = mlrun.data.tags
    assert tags["tensorflow"].startswith("2.") and tags["keras"].startswith("3.")
    assert tags["device"] == "/CPU:0"
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id)}
    assert {"config.yaml", "overrides.txt"} <= artifacts
    check_contract(client, mlrun.info.run_id, model)


def test_transformer_loss_really_falls_and_max_steps_null_trains_epochs(tiny_cfg):
    # One run for both: max_steps=null trains epochs x steps per epoch (2 x 40 // 4 = 20
    # optimizer steps), and over them the tiny transformer learns the next-token rule (20
    # steps at lr 0.03 ended near a loss of 0.5 and an accuracy of 0.8).
    epochs = ["trainer.max_steps=null", "trainer.epochs=2", "data.train_samples=40"]
    result = run(tiny_cfg("transformer", *epochs, "trainer.lr=0.03"))
    assert result["steps"] == 2 * (40 // 4)
    assert result["train/final_loss"] < 0.5 * 2.77  # ln(16) = 2.77 at the start
    assert result["val/accuracy"] > 0.5


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_precision_policy_is_restored_after_run(precision, tiny_cfg, store):
    before = keras.config.dtype_policy().name
    result, client, mlrun = _run_and_fetch(tiny_cfg("transformer", f"precision={precision}"), store)
    assert mlrun.info.status == "FINISHED"
    assert keras.config.dtype_policy().name == before
    assert mlrun.data.params["precision.policy"] in ("mixed_float16", "mixed_bfloat16")
    scales = client.get_metric_history(mlrun.info.run_id, "precision/loss_scale")
    if precision == "mixed":  # float16: dynamic loss scale per step, skipped steps counted
        assert [m.step for m in scales] == [1, 2, 3]
        values = [2.0**15] + [m.value for m in scales]  # starts at 2^15; halves on each skip
        drops = sum(b < a for a, b in zip(values, values[1:], strict=False))
        assert mlrun.data.metrics["precision/skipped_steps"] == drops
    else:  # bfloat16 has float32's range: no loss scaling
        assert scales == [] and "precision/skipped_steps" not in mlrun.data.metrics


def test_digits_trains_real_data(store):
    cfg = compose_config(
        [
            "data=digits",
            "model.h=16",
            "model.layers=1",
            "model.heads=2",
            "trainer.max_steps=5",
            "trainer.progress=false",
            f"mlflow.tracking_uri={store}",
        ]
    )
    result = run(cfg)
    assert 0.0 <= result["val/accuracy"] <= 1.0


def test_failing_run_is_marked_failed_with_its_error(tiny_cfg, store, tmp_path):
    broken = tmp_path / "broken.weights.h5"
    broken.write_bytes(b"not an hdf5 file")
    cfg = tiny_cfg("transformer", f"model.weights={broken}")
    with pytest.raises(Exception):  # noqa: B017 - whatever Keras raises must propagate
        run(cfg)
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("tfmemlab")
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert mlrun.info.status == "FAILED"
    assert mlrun.data.tags["error"]
