"""What a run keeps and says about itself (issue 28): the trained model (model.keras and an MLflow
logged model that reloads to the run's final predictions), the pruned model stripped, the git
source and the datasets with digests of their data, and the model's link in a comparison.

Three tiny in-process runs in one real SQLite store, shared by the tests of this module: a
pruned run that keeps its model, the same data without keeping one, and another seed.
"""

import subprocess
import sys
from pathlib import Path

import keras
import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from runner.config import compose_config
from runner.feed.pipelines import build_data
from runner.track import compare
from runner.track.client import scratch_store
from runner.track.commit import source_tags
from runner.track.datasets import digest, log_datasets
from runner.track.model import FILE, custom_objects, keep_model, load
from runner.track.model import main as model_command
from runner.track.tracker import PENDING, Tracker, WorkerTracker
from runner.train import run
from tests.conftest import REPO, tiny_overrides

KEEP = ["trainer.save_model=true", "trainer.jit_compile=false"]  # eager-equal evaluation
PRUNED = ["pruning=constant", "model.h=32", "model.heads=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(store, {name: (cfg, result)}): kept (pruned, model kept), same (same data, no model),
    other (another seed, no model)."""
    folder = tmp_path_factory.mktemp("keep")
    store = scratch_store(folder)
    jobs = {
        "kept": [*PRUNED, *KEEP],
        "same": [*PRUNED[1:], "trainer.jit_compile=false"],
        "other": [*PRUNED[1:], "trainer.jit_compile=false", "trainer.seed=1"],
    }
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)  # outside Hydra the run directory is ./outputs/runs/<run id>
        for name, extra in jobs.items():
            cfg = compose_config([*tiny_overrides("transformer", store), *extra])
            out[name] = (cfg, run(cfg))
    return store, out


def _run_dir(client: MlflowClient, run_id: str) -> Path:
    return Path(client.get_run(run_id).data.tags["run_dir"])


def _val_loss(model: keras.Model, cfg) -> float:
    """The validation loss as runner/train/loop.py's evaluate computes it."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    total = count = 0.0
    for x, y in build_data(cfg, False).val:
        n = float(np.size(y))
        total += float(loss_fn(y, model(x, training=False))) * n
        count += n
    return total / count


def test_logged_model_reloads_to_the_trained_model(runs):
    """The logged model, loaded back with mlflow.keras, gives the run's final validation loss
    (measured after the last step): a model logged before training would not."""
    store, jobs = runs
    cfg, result = jobs["kept"]
    client = MlflowClient(store)
    mlrun = client.get_run(result["run_id"])
    uri = mlrun.data.tags["model_uri"]
    assert [o.model_id for o in mlrun.outputs.model_outputs] == [uri.removeprefix("models:/")]
    mlflow.set_tracking_uri(store)
    try:
        by_run = mlflow.keras.load_model(
            f"runs:/{result['run_id']}/model", custom_objects=custom_objects()
        )
        by_id = load(uri)
        info = mlflow.models.get_model_info(uri)
    finally:
        mlflow.set_tracking_uri(None)
    assert _val_loss(by_run, cfg) == pytest.approx(result["val/loss"], rel=1e-6, abs=1e-6)
    assert info.signature is not None and info.saved_input_example_info is not None
    batch = next(iter(build_data(cfg, False).val))[0]  # a fixed batch
    kept = keras.saving.load_model(
        _run_dir(client, result["run_id"]) / FILE, custom_objects=custom_objects()
    )
    expected = np.asarray(kept(batch, training=False))
    for model in (by_run, by_id):
        np.testing.assert_allclose(np.asarray(model(batch, training=False)), expected, atol=1e-6)


@pytest.mark.slow  # a fresh process importing TensorFlow and MLflow: about 12 s of CPU
def test_the_model_command_loads_a_kept_model_quietly(runs):
    """`python -m runner.track.model URI` as typed, in a fresh process (TensorFlow's start-up
    lines are printed when a process imports it): the model and its example's outputs on
    stdout, nothing on stderr."""
    store, jobs = runs
    uri = MlflowClient(store).get_run(jobs["kept"][1]["run_id"]).data.tags["model_uri"]
    result = subprocess.run(
        [sys.executable, "-m", "runner.track.model", uri, "--tracking-uri", store],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
    assert result.stdout.startswith(f"{uri}: transformer, ")
    assert "input example (2, 8) -> outputs (2, 8, 16) float32" in result.stdout


def test_the_model_command_says_a_bad_uri_in_one_line(store):
    try:
        with pytest.raises(SystemExit) as exit_:
            model_command(["runs:/nope/model", "--tracking-uri", store])
    finally:
        mlflow.set_tracking_uri(None)  # main() sets it for the process
    assert exit_.value.code == "error: runs:/nope/model: Run with id=nope not found"


def test_pruned_model_is_kept_stripped_with_its_zeros(runs):
    """One model file, the pruned model as a plain Keras model: no mask variables or wrappers,
    each pruned kernel with the zeros the run's table counts."""
    store, jobs = runs
    _, result = jobs["kept"]
    client = MlflowClient(store)
    run_dir = _run_dir(client, result["run_id"])
    assert not (run_dir / "pruned_model.keras").exists()
    model = keras.saving.load_model(run_dir / FILE, custom_objects=custom_objects())
    assert not [v.path for v in model.variables if "mask" in v.path.lower()]
    kinds = {type(layer).__name__ for layer in model._flatten_layers()}
    assert not [k for k in kinds if "prune" in k.lower() or "wrapper" in k.lower()]
    table = client.download_artifacts(result["run_id"], "pruning_table.csv")
    rows = {r.split(",")[0]: r.split(",") for r in Path(table).read_text().splitlines()[1:]}
    kernels = [v for v in model.trainable_variables if v.path in rows]
    assert len(kernels) == len(rows) == 7
    for kernel in kernels:
        assert (kernel.numpy() == 0).mean() == pytest.approx(0.5, abs=0.01), kernel.path
    assert result["prune/sparsity"] == pytest.approx(0.5, abs=0.01)


def test_save_model_false_keeps_nothing(runs):
    store, jobs = runs
    _, result = jobs["same"]
    client = MlflowClient(store)
    mlrun = client.get_run(result["run_id"])
    assert not (_run_dir(client, result["run_id"]) / FILE).exists()
    assert "model_uri" not in mlrun.data.tags
    assert not mlrun.outputs.model_outputs
    models = client.search_logged_models([mlrun.info.experiment_id])
    assert [m.source_run_id for m in models] == [jobs["kept"][1]["run_id"]]


def test_run_says_which_code_and_which_data(runs):
    """Source: the commit of tfmemlab's repository; datasets: each split with a digest equal
    for runs on the same data, different for another seed."""
    store, jobs = runs
    client = MlflowClient(store)
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    digests = {}
    for name, (_, result) in jobs.items():
        mlrun = client.get_run(result["run_id"])
        tags = mlrun.data.tags
        assert tags["mlflow.source.git.commit"] == head
        assert tags["git_dirty"] in ("true", "false") and tags["mlflow.source.type"] == "LOCAL"
        inputs = {
            {t.key: t.value for t in i.tags}["mlflow.data.context"]: i.dataset
            for i in mlrun.inputs.dataset_inputs
        }
        assert set(inputs) == {"training", "validation"}
        assert inputs["training"].name == "synthetic:train"
        assert '"generator"' in inputs["training"].source
        digests[name] = (inputs["training"].digest, inputs["validation"].digest)
        assert tags["data/train_digest"] == digests[name][0]
    assert digests["kept"] == digests["same"]
    assert digests["other"][0] != digests["same"][0]
    assert digests["other"][1] != digests["same"][1]
    cfg = jobs["same"][0]  # the batches trained on first are a fresh pipeline's first
    keras.utils.set_random_seed(cfg.trainer.seed)
    fresh = build_data(cfg, False)
    assert digests["same"] == (digest(fresh.train), digest(fresh.val))


def test_comparison_links_each_jobs_model(runs, tmp_path):
    store, jobs = runs
    client = MlflowClient(store)
    chosen = [client.get_run(jobs[name][1]["run_id"]) for name in ("kept", "same")]
    rows = compare.rows(chosen)
    assert rows[0]["model"] == chosen[0].data.tags["model_uri"].strip()
    assert rows[0]["model"].startswith("models:/m-") and rows[1]["model"] == ""
    markdown = compare.write_markdown(rows, tmp_path / "comparison.md").read_text()
    assert rows[0]["model"] in markdown
    assert "models:/" not in compare.text(rows)  # the terminal's table stays narrow


def test_a_failed_run_keeps_no_model(tiny_cfg, store, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = tiny_cfg("transformer", *KEEP, "trainer.max_steps=50", "trainer.optimizer=sgd")
    cfg.trainer.lr = 1e12  # diverges within a few steps: FloatingPointError
    with pytest.raises(FloatingPointError):
        run(cfg)
    client = MlflowClient(store)
    (failed,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert failed.info.status == "FAILED" and "model_uri" not in failed.data.tags
    assert not (_run_dir(client, failed.info.run_id) / FILE).exists()
    assert not client.search_logged_models([failed.info.experiment_id])


def test_no_git_and_non_chief_workers_log_nothing(tmp_path):
    tags = source_tags(tmp_path)  # not a repository: said in a tag, no error
    assert tags["git_dirty"] == "unknown" and "not a git repository" in tags["git"]
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    worker = WorkerTracker("worker")
    assert keep_model(worker, model, tmp_path / "run", np.zeros((2, 4), "float32"), 3) is None
    assert not (tmp_path / "run").exists()
    assert log_datasets(worker, compose_config([]).data, {}) == {}


def test_a_lost_server_keeps_the_model_file_and_training_goes_on(tmp_path):
    """A server that stops answering while the model is logged: the file stays, the run goes
    on (the call is noted in the pending file, as every call after a loss is)."""
    client = MlflowClient("http://127.0.0.1:9")  # remote: the tracker keeps what it cannot send
    tracker = Tracker(client, "run", "0", "lost", pending=tmp_path / PENDING)

    def unanswered() -> str:
        raise ConnectionError("no answer")

    assert tracker.log_model(unanswered) is None and tracker.lost is not None
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    example = np.zeros((2, 4), "float32")
    assert keep_model(tracker, model, tmp_path / "run", example, 3) is None
    assert (tmp_path / "run" / FILE).is_file()
    assert "in the run directory only" in (tmp_path / PENDING).read_text()
