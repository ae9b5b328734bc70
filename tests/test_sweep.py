"""Sweeps as one comparable experiment: parent and child runs, failures, the report, and
memory figures that do not depend on the jobs before them."""

import pytest
from mlflow.tracking import MlflowClient

from runner.track import compare
from tests.conftest import TINY, TINY_DATA, run_cli

TINY_ARGS = TINY["transformer"] + TINY_DATA + ["trainer.max_steps=3"]
REPORT = {
    "report/comparison.csv",
    "report/comparison.md",
    "report/pareto.png",
    "report/bar_peak_MiB.png",
    "report/memory_breakdown.png",
}


def _sweep(store: str):
    """(parent, children in job order) of the one sweep in the store."""
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("tfmemlab")
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    children = compare.sweep_runs(client, parent.info.run_id)
    return client, parent, children


@pytest.mark.slow
def test_sweep_against_an_mlflow_server(tmp_path, mlflow_server):
    result = run_cli(
        ["-m", "precision=fp32,bf16", *TINY_ARGS],
        cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": mlflow_server},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    client, parent, children = _sweep(mlflow_server)
    assert parent.info.status == "FINISHED"
    assert [c.data.tags["job_num"] for c in children] == ["0", "1"]
    assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id for c in children)
    assert [c.info.run_name for c in children] == ["baseline", "bf16"]  # what differs
    assert children[1].data.tags["overrides"].startswith("precision=bf16")
    assert [c.data.params["precision.policy"] for c in children] == ["float32", "mixed_bfloat16"]
    assert all(c.data.metrics["mem/peak_bytes"] > 0 for c in children)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert REPORT <= artifacts
    assert "peak_MiB/base" in result.stdout  # the table printed at the end of the sweep


@pytest.mark.slow
def test_joblib_workers_share_one_sqlite_store(tmp_path, store):
    result = run_cli(
        [
            "-m",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            "precision=fp32,bf16",
            *TINY_ARGS,
        ],
        cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": store},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _, parent, children = _sweep(store)
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)


# Both ways a sweep runs its jobs: each in a fresh process (default) and in-process.
@pytest.mark.parametrize("isolate", ["true", "false"])
def test_failed_job_is_recorded_and_the_sweep_goes_on(isolate, tmp_path, store, capsys):
    result = run_cli(
        [
            "-m",
            "trainer.optimizer=sgd",
            "trainer.lr=0.01,1e30",
            f"sweep.isolate={isolate}",
            *TINY_ARGS,
        ],
        cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": store},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "job 1 failed" in result.stderr
    client, parent, children = _sweep(store)
    assert [c.info.status for c in children] == ["FINISHED", "FAILED"]
    assert children[1].data.tags["failure"] == "nan" and children[1].data.tags["error"]
    assert parent.data.tags["failed_jobs"] == "1"
    # The parent's description is the sweep's summary: its table and where to open it.
    note = parent.data.tags["mlflow.note.content"]
    experiment = parent.info.experiment_id
    assert "peak_MiB/base" in note and note in result.stdout
    assert f"#/experiments/{experiment}/runs?workflowType=machine_learning" in note
    assert f"mlflow ui --backend-store-uri {store}" in note
    # Child runs are renamed by what differs from the baseline; their overrides stay as a tag.
    assert [c.info.run_name for c in children] == ["baseline", "trainer.lr=1e+30"]
    assert "trainer.lr=1e+30" in children[1].data.tags["overrides"]
    assert "MLflow: run 'baseline' (overrides: " in children[0].data.tags["mlflow.note.content"]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert REPORT <= artifacts
    # The terminal comparison reads the same runs.
    rows = compare.main(["--sweep", parent.info.run_id, "--tracking-uri", store])
    assert [r["status"] for r in rows] == ["FINISHED", "FAILED"]
    assert rows[0]["peak_MiB/base"] == 1.0 and "FAILED" in capsys.readouterr().out


@pytest.mark.slow
def test_a_jobs_peak_does_not_depend_on_the_jobs_before_it(tmp_path, store):
    # Jobs 0 and 2 are the same job; job 1 is larger. Each job runs in a fresh process
    # (sweep.isolate, the default). Identical runs varied by ~5% here.
    args = [
        "model.h=64",
        "model.layers=1",
        "model.heads=2",
        "data.seq_len=64",
        "data.vocab_size=64",
        "data.train_samples=256",
        "data.val_samples=8",
        "trainer.max_steps=3",
        "data.batch_size=8,64,8",
    ]
    result = run_cli(["-m", *args], cwd=tmp_path, env={"MLFLOW_TRACKING_URI": store})
    assert result.returncode == 0, result.stderr[-3000:]
    _, _, (first, larger, again) = _sweep(store)
    peak = [r.data.metrics["mem/peak_bytes"] for r in (first, larger, again)]
    assert peak[1] > 2 * peak[0]  # the job in between really was larger
    assert peak[2] == pytest.approx(peak[0], rel=0.10)


@pytest.mark.slow
def test_memory_study_preset_runs_its_six_variants(tmp_path, store):
    # The preset sets hydra.mode=MULTIRUN: each isolated job must run once, not sweep again.
    tiny = [
        "model.h=16",
        "model.layers=2",
        "model.heads=2",
        "data.seq_len=8",
        "data.vocab_size=16",
        "data.train_samples=64",
        "data.val_samples=8",
        "trainer.max_steps=2",
        f"mlflow.tracking_uri={store}",
    ]
    result = run_cli(["+experiment=memory_study", *tiny], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("memory_study").experiment_id])
    parents = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    children = [r for r in runs if r.data.tags.get("sweep") != "parent"]
    assert len(parents) == 1 and len(children) == 6
    assert all(r.info.status == "FINISHED" for r in children)
    policies = sorted(r.data.params["precision.policy"] for r in children)
    assert policies.count("float32") == 4 and "mixed_float16" in policies
    # Every job at the baseline's effective batch (issue 13: accum4 once ran 4 x 16), named
    # by what differs from the baseline, every ratio like for like.
    by_name = {r.info.run_name: r.data.params for r in children}
    assert set(by_name) == {
        "baseline",
        "mixed",
        "bf16",
        "accum=4",
        "checkpointing=blocks",
        "pruning=polynomial",
    }
    assert {p["effective_batch_size"] for p in by_name.values()} == {"16"}
    assert (by_name["accum=4"]["data.batch_size"], by_name["accum=4"]["accum"]) == ("4", "4")
    assert "peak_MiB/base" in result.stdout and "not like for like" not in result.stdout
