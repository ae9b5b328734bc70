"""runner.launch's refusals around the network (issue 27), with real processes and no training:
its workers run in a private network namespace, loopback only, so a tracking server (which
that namespace cannot reach) and a system that cannot make the namespace are refused in one
line before any worker starts, unless --allow-network. That the workers of a real launch
listen in no network but the namespace's is checked in test_distribution.py, during a launch.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner import launch
from tests.conftest import REPO, run_launch, tiny_overrides

SERVER = "http://127.0.0.1:9"  # nothing answers there


def _launch_folder(tmp_path: Path, uri: str) -> Path:
    """The folder a stopped 2-worker launch leaves, as --resume reads it (run.json, the
    checkpoint manager's index), its chief logging to `uri`."""
    folder = tmp_path / "launch"
    for i in range(2):
        run_dir = folder / f"worker{i}"
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints" / "checkpoint").write_text('model_checkpoint_path: "ckpt-3"\n')
        config = {"trainer": {"max_steps": 10}, "mlflow": {"tracking_uri": uri}}
        record = {"run_id": "0", "tracking_uri": uri, "job": "default", "config": config}
        (run_dir / "run.json").write_text(json.dumps(record))
    return folder


def _one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stdout + result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "uri, network",
    [
        ("sqlite:///outputs/mlflow.db", False),
        ("sqlite:////tmp/mlflow.db", False),
        ("file:///tmp/mlruns", False),
        ("mlruns", False),
        ("http://127.0.0.1:5000", True),  # the host's loopback is not the namespace's
        ("https://mlflow.example.org", True),
        ("postgresql://user@db/mlflow", True),
        ("databricks", True),
    ],
)
def test_which_stores_need_the_network(uri, network):
    assert launch.needs_network(uri) is network


def test_a_tracking_server_is_refused_in_one_line_naming_allow_network(tmp_path):
    result = run_launch("--dir", str(tmp_path / "l"), "--", f"mlflow.tracking_uri={SERVER}")
    line = _one_line(result)
    assert f"mlflow.tracking_uri={SERVER}" in line and "--allow-network" in line
    assert list(tmp_path.iterdir()) == []  # no launch folder, no worker
    # --allow-network lets it through to the next check: is the server there?
    result = run_launch(
        "--allow-network", "--dir", str(tmp_path / "l"), "--", f"mlflow.tracking_uri={SERVER}"
    )
    assert "no MLflow server answered" in _one_line(result)


def test_resuming_a_launch_that_logs_to_a_server_is_refused_too(tmp_path):
    folder = _launch_folder(tmp_path, SERVER)
    line = _one_line(run_launch("--resume", str(folder)))
    assert f"mlflow.tracking_uri={SERVER}" in line and "--allow-network" in line
    assert not list(folder.glob("worker*/resumed"))  # no worker started


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_without_user_namespaces_the_launch_is_refused_in_one_line_naming_allow_network(tmp_path):
    # A system that allows no user namespace: a user namespace of the test's own, whose limit
    # on further ones (user.max_user_namespaces, per namespace) is set to 0.
    # A tiny job: were it not refused, its workers would end soon, and the test would fail.
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = [*tiny_overrides("transformer", store), "trainer.max_steps=1"]
    launch = [sys.executable, "-m", "runner.launch", "--dir", str(tmp_path / "l"), "--", *job]
    script = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
    result = subprocess.run(
        ["unshare", "-r", "sh", "-c", script, "sh", *launch],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = _one_line(result)
    assert "no private network" in line and "max_user_namespaces" in line, line
    assert "--allow-network" in line
    assert list(tmp_path.iterdir()) == []
