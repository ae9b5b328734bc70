"""What a user sees first and last (issue 13, items 6, 9). What a job failing in device setup
leaves behind (item 9) is checked with the in-process sweep in tests/test_sweep.py."""

import json
import os
import subprocess
import sys
import time
import urllib.request

from mlflow.tracking import MlflowClient

from runner.bench.ui import start_ui, stop_ui, tree_rss
from tests.conftest import NO_MODEL, REPO, TINY, TINY_DATA, free_port

TINY_ARGS = [*TINY["transformer"], *TINY_DATA, "trainer.max_steps=3", "trainer.progress=false"]
TINY_ARGS += NO_MODEL
TF_NOISE = ("absl::InitializeLog", "I0000", "cuInit", "oneDNN custom operations")


def _cli(args, cwd, **env):
    """run.py with the environment of a fresh shell: no log level set by this test process."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CPP_MIN_LOG_LEVEL", "TFMEMLAB_QUIET_TF")
    }
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=cwd,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_run_speaks_first_and_says_where_to_look(tmp_path, store):
    result = _cli([*TINY_ARGS, f"mlflow.tracking_uri={store}"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[0].startswith("tfmemlab: job ")
    assert not [line for line in result.stderr.splitlines() if any(n in line for n in TF_NOISE)]
    client = MlflowClient(tracking_uri=store)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
    run_id, experiment = mlrun.info.run_id, mlrun.info.experiment_id
    url = f"#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning"
    assert url in result.stdout
    _the_printed_ui_serves_the_run_in_two_processes(result.stdout, store, run_id)
    # The run page's description is the summary printed at the end.
    note = mlrun.data.tags["mlflow.note.content"]
    assert "peak" in note and url in note and note in result.stdout
    assert "ms p50 (p10-p90 " in note  # how steady the timed steps were
    # The CPU's model and cores, not "/CPU:0": figures compare only within one device.
    name = mlrun.data.tags["device_name"]
    assert name.startswith("CPU ") and name != "CPU unknown" and "core" in name


def _the_printed_ui_serves_the_run_in_two_processes(stdout: str, store: str, run_id: str):
    """The UI command the summary prints, started as printed (issue 48): plain `mlflow ui`
    (MLflow 3.17) started 4 server workers and 8 GenAI job workers, 15 processes and 3.2 GB of
    RSS here; as printed, the server and its one worker (`python -m runner.bench ui`)."""
    (line,) = [ln for ln in stdout.splitlines() if "open the UI: " in ln]
    command = line.split("open the UI: ", 1)[1]
    assert command.endswith(f"mlflow ui --workers 1 --backend-store-uri {store}"), command
    port = free_port()
    ui = start_ui(command, port)
    try:
        time.sleep(5)  # the job runner's workers start after the server answers
        _, processes = tree_rss(ui.pid)
        api = f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/get?run_id={run_id}"
        answer = json.loads(urllib.request.urlopen(api, timeout=10).read())
    finally:
        stop_ui(ui)
    assert processes <= 2, processes
    assert answer["run"]["info"]["run_id"] == run_id


def test_a_log_level_the_user_sets_still_wins(tmp_path, store):
    result = _cli(
        [*TINY_ARGS, "trainer.max_steps=1", f"mlflow.tracking_uri={store}"],
        tmp_path,
        TF_CPP_MIN_LOG_LEVEL="0",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Printed while TensorFlow loads: the import itself was not silenced.
    assert "oneDNN custom operations" in result.stderr
