"""Sweeps on Hydra's cluster launchers (issue 18): submitit (locally) and Ray, each job in a
process of its own, all logging to one store under the sweep's parent run."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port, run_cli
from tests.test_sweep import TINY_ARGS, _sweep

# Two jobs: enough to show each in a process of its own, in order, under one parent run.
JOBS = ["precision=fp32,bf16"]


def _two_finished_children(store: str) -> None:
    _, parent, children = _sweep(store)
    assert parent.info.status == "FINISHED"
    assert [c.info.status for c in children] == ["FINISHED"] * 2
    assert [c.data.tags["job_num"] for c in children] == ["0", "1"]
    assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id for c in children)
    assert [c.data.params["precision.name"] for c in children] == ["fp32", "bf16"]
    # Each job trained in a process of its own, its memory figures its own.
    assert len({c.data.tags["pid"] for c in children}) == 2
    assert all(c.data.metrics["mem/peak_bytes"] > 0 for c in children)


@pytest.mark.slow
def test_a_sweep_through_submitit_local(tmp_path, store):
    # submitit starts a fresh process for each job already: the job trains there
    # (sweep.isolate=false) rather than in one more process started from it. A job isolated
    # inside a launcher's worker is the Ray test's.
    result = run_cli(
        ["-m", "hydra/launcher=submitit_local", "sweep.isolate=false", *JOBS, *TINY_ARGS],
        cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": store},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _two_finished_children(store)


def _ray(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    ray = Path(sys.executable).parent / "ray"
    return subprocess.run([str(ray), *args], cwd=cwd, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_a_sweep_through_ray_on_a_ray_instance_started_apart(tmp_path, store):
    # A Ray instance of its own (as a cluster would be): its workers do not inherit the
    # sweep's environment, so the jobs find their parent run in the sweep folder.
    port = free_port()
    started = _ray(
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--object-store-memory=78643200",
        cwd=tmp_path,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        result = run_cli(
            [
                "-m",
                "hydra/launcher=ray",
                # auto: the instance `ray start` began on this machine, with the token that
                # Ray 2.60's authentication asks of a client (an address alone is refused).
                "hydra.launcher.ray.init.address=auto",
                # The plugin sets a default object store size, which ray.init refuses for a
                # cluster it connects to: none is given.
                "+hydra.launcher.ray.init.object_store_memory=null",
                *JOBS,
                *TINY_ARGS,
            ],
            cwd=tmp_path,
            env={"MLFLOW_TRACKING_URI": store},
        )
    finally:
        _ray("stop", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _two_finished_children(store)
