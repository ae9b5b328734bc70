"""`python run.py ...` exactly as a user types it, in a subprocess, against a temp store."""

from mlflow.tracking import MlflowClient

from runner.config import compose_config
from tests.conftest import NO_MODEL, TINY, TINY_DATA, run_cli

TINY_ARGS = TINY["transformer"] + TINY_DATA + ["trainer.max_steps=3", *NO_MODEL]


def _runs(store):
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("tfmemlab")
    return client.search_runs([experiment.experiment_id])


def test_mixed_precision_with_accumulation_as_typed(tmp_path, store):
    # The store given on the command line too: where a run is kept is not in its name.
    typed = ["precision=mixed", "accum=4", *TINY_ARGS]
    result = run_cli(
        [*typed, f"mlflow.tracking_uri={store}"], cwd=tmp_path, env={"MLFLOW_TRACKING_URI": store}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "precision=mixed accum=4 on /CPU:0: 3 steps" in result.stdout
    assert "float16" in result.stderr  # the one-time note that fp16 on a CPU is slow
    (mlrun,) = _runs(store)
    assert mlrun.info.status == "FINISHED"
    assert mlrun.info.run_name == " ".join(typed)
    assert mlrun.data.params["precision.policy"] == "mixed_float16"
    assert mlrun.data.params["effective_batch_size"] == "16"


# A sweep as typed (one run per job, its values, outputs/multirun): tests/test_sweep.py,
# test_sweep_against_an_mlflow_server.


def test_cfg_job_prints_the_composed_config(tmp_path):
    """With a user's folder (--config-dir) whose model/mobilenet.yaml is named like a shipped
    one: it does not shadow conf/'s, for Hydra nor for the command-line check nor for
    compose_config (runner.plan, the tests). Hydra puts --config-dir after conf/ on its search
    path (`--info searchpath`: hydra, main = conf/, command-line, schema), and a config is
    taken from the first folder that has it. The user's file holds a version the check would
    refuse, so a check that read it first would stop the command."""
    mine = tmp_path / "myconf"
    (mine / "model").mkdir(parents=True)
    (mine / "model" / "mobilenet.yaml").write_text(
        "defaults:\n  - base_mobilenet\n  - _self_\nversion: v9\n"
    )
    args = ["--config-dir", str(mine), "--cfg", "job", "accum=4", "model=mobilenet"]
    result = run_cli(args, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "accum: 4" in result.stdout and "version: v2" in result.stdout
    assert compose_config(["model=mobilenet"], config_dir=mine).model.version == "v2"


def test_help_lists_the_config_groups(tmp_path):
    result = run_cli(["--help"], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    for line in (
        "model: efficientnet, keras_app, mobilenet, transformer",
        "precision: bf16, fp32, mixed",
    ):
        assert line in result.stdout
