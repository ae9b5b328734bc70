"""Sweeps that resume (issue 16): real sweeps, real signals, a real store, real checkpoints."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorflow as tf
from mlflow.tracking import MlflowClient

from runner.config import compose_config
from runner.sweep.resume import ATTEMPTS, plan_job, resume_argv
from runner.sweep.state import SWEEP_FILE, write_sweep_file
from runner.track.client import experiment_id
from runner.track.compare import sweep_runs
from runner.track.rundir import write_run_file
from tests.conftest import MEMORY_BOUND, REPO, TINY, run_cli, tiny_overrides

# ---- what a relaunched sweep does with each job: real runs, real checkpoints ----------------


def _attempt(tmp_path: Path, store: str, status: str, steps_done: int | None, **tags) -> Path:
    """A job folder as a sweep's job leaves it: run.json, an MLflow run in `status` with the
    process tags mlflow_run sets, and a real checkpoint after `steps_done` steps (or none)."""
    job_dir = tmp_path / f"job-{len(list(tmp_path.glob('job-*')))}"
    client = MlflowClient(tracking_uri=store)
    experiment = experiment_id(client, "tfmemlab", store)
    process = {"host": os.uname().nodename, "pid": str(os.getpid())}
    run = client.create_run(experiment, tags={**process, **tags})
    if status != "RUNNING":
        client.set_terminated(run.info.run_id, status=status)
    cfg = compose_config([*tiny_overrides("transformer", store), "trainer.max_steps=10"])
    write_run_file(job_dir, run.info.run_id, cfg, [])
    if steps_done is not None:
        step = tf.Variable(steps_done)
        manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(steps_done=step), str(job_dir / "checkpoints"), 2
        )
        manager.save(checkpoint_number=steps_done)
    (job_dir / "metrics.json").write_text("{}")
    return job_dir


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_relaunched_sweep_skips_finished_jobs_resumes_stopped_ones_and_reruns_failed_ones(
    tmp_path, store
):
    client = MlflowClient(tracking_uri=store)
    finished = _attempt(tmp_path, store, "FINISHED", 10)
    killed = _attempt(tmp_path, store, "KILLED", 4)
    lost = _attempt(tmp_path, store, "RUNNING", 6)
    client.set_tag(json.loads((lost / "run.json").read_text())["run_id"], "pid", _exited_pid())
    busy = _attempt(tmp_path, store, "RUNNING", 6)  # its process (this one) is alive
    failed = _attempt(tmp_path, store, "FAILED", 4, failure="nan")
    no_checkpoint = _attempt(tmp_path, store, "KILLED", None)
    all_steps_done = _attempt(tmp_path, store, "KILLED", 10)
    lost_early = _attempt(tmp_path, store, "RUNNING", None)
    client.set_tag(
        json.loads((lost_early / "run.json").read_text())["run_id"], "pid", _exited_pid()
    )

    plans = {
        name: plan_job(job_dir)
        for name, job_dir in [
            ("finished", finished),
            ("killed", killed),
            ("lost", lost),
            ("busy", busy),
            ("failed", failed),
            ("no_checkpoint", no_checkpoint),
            ("all_steps_done", all_steps_done),
            ("lost_early", lost_early),
            ("never_started", tmp_path / "job-none"),
        ]
    }
    assert {name: plan.action for name, plan in plans.items()} == {
        "finished": "skip",
        "killed": "resume",
        "lost": "resume",
        "busy": "busy",
        "failed": "rerun",
        "no_checkpoint": "rerun",
        "all_steps_done": "rerun",
        "lost_early": "rerun",
        "never_started": "run",
    }
    assert "FAILED (nan)" in plans["failed"].reason
    assert "wrote no checkpoint" in plans["no_checkpoint"].reason
    assert "finished all its 10 optimizer steps" in plans["all_steps_done"].reason
    # What resumes stays where the job goes on from it.
    for job_dir in (finished, killed, lost, busy):
        assert (job_dir / "run.json").is_file() and (job_dir / "checkpoints").is_dir()
    # What runs again has its last attempt moved aside, whole, and its run marked superseded.
    for name, job_dir in [
        ("failed", failed),
        ("no_checkpoint", no_checkpoint),
        ("all_steps_done", all_steps_done),
        ("lost_early", lost_early),
    ]:
        run_id = plans[name].run_id
        assert not (job_dir / "run.json").exists() and not (job_dir / "checkpoints").exists()
        moved = job_dir / ATTEMPTS / run_id
        assert json.loads((moved / "run.json").read_text())["run_id"] == run_id
        assert (moved / "metrics.json").is_file()
        assert (moved / "checkpoints").is_dir() == (name in ("failed", "all_steps_done"))
        assert "superseded" in client.get_run(run_id).data.tags
    # A run left RUNNING by a process that is gone is closed when its job runs again.
    assert client.get_run(plans["lost_early"].run_id).info.status == "KILLED"
    assert client.get_run(plans["busy"].run_id).info.status == "RUNNING"


def test_the_comparison_of_a_resumed_sweep_covers_each_job_once(store):
    client = MlflowClient(tracking_uri=store)
    experiment = client.create_experiment("tfmemlab")
    parent = client.create_run(experiment, tags={"sweep": "parent"}).info.run_id
    children = {"mlflow.parentRunId": parent, "sweep_id": parent}
    first = client.create_run(experiment, tags={**children, "job_num": "0"}).info.run_id
    failed = client.create_run(experiment, tags={**children, "job_num": "1"}).info.run_id
    client.set_tag(failed, "superseded", "the job ran again")
    again = client.create_run(experiment, tags={**children, "job_num": "1"}).info.run_id
    assert [r.info.run_id for r in sweep_runs(client, parent)] == [first, again]


def test_resuming_a_sweep_fills_in_its_overrides_and_refuses_others(tmp_path):
    sweep_dir = tmp_path / "sweep"
    task = ["accum=1,2", "precision=fp32,mixed"]
    write_sweep_file(sweep_dir, "abc", "sqlite:///x.db", "tfmemlab", task, ["hydra.mode=MULTIRUN"])
    assert resume_argv([f"sweep.resume={sweep_dir}"]) == [
        "-m",
        *task,
        f"sweep.resume={sweep_dir}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    assert resume_argv(["-m", *task, f"sweep.resume={sweep_dir}"])[1:3] == task
    assert resume_argv(["accum=4"]) == ["accum=4"]  # no resume: as typed

    # From a user's shell: one line each, before TensorFlow or a store is touched.
    for args, expected in [
        (
            ["-m", "precision=fp32,mixed", "accum=1,2", f"sweep.resume={sweep_dir}"],
            f"error: sweep.resume={sweep_dir}: that sweep ran 'accum=1,2 precision=fp32,mixed'; "
            "give the same overrides in the same order",
        ),
        (
            [f"sweep.resume={tmp_path}"],
            f"error: sweep.resume={tmp_path}: no readable {SWEEP_FILE} there",
        ),
        (
            ["-m", "accum=3,4", "sweep.resume=latest"],
            "error: sweep.resume=latest: no sweep of the overrides 'accum=3,4' under outputs/",
        ),
    ]:
        result = run_cli(args, tmp_path, None, 120)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr.strip().startswith(expected), result.stderr[-2000:]
        assert len(result.stderr.strip().splitlines()) == 1


# ---- whole sweeps, stopped and resumed -----------------------------------------------------


def _sweep(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a signal in the test goes to the sweep's process alone
    )


def _wait_for(path: Path, sweep: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert sweep.poll() is None, sweep.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {path} after {seconds} s"
        time.sleep(0.01)


def _wait_gone(pid: int, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still running after {seconds} s")


def _by_job(client: MlflowClient, parent: str) -> dict[str, list]:
    """Every run of the sweep (superseded ones too), by job number, oldest first."""
    experiment = client.get_run(parent).info.experiment_id
    runs = client.search_runs([experiment], f"tags.sweep_id = '{parent}'")
    jobs: dict[str, list] = {}
    for run in sorted(runs, key=lambda r: r.info.start_time):
        jobs.setdefault(run.data.tags["job_num"], []).append(run)
    return jobs


@pytest.mark.slow
def test_a_sweep_killed_during_job_3_resumes_without_running_job_1_again(tmp_path, store):
    sweep_dir = tmp_path / "sweep"
    # 60 steps, a checkpoint every 5: after job 3's first checkpoint it has 55 steps to go
    # (seconds), ample for the kill to reach it mid-run.
    steps = 60
    args = [
        "-m",
        "data.batch_size=4,128,8,12",  # job 2 (128: ~74 MiB) runs out of memory under 64
        *MEMORY_BOUND,
        f"trainer.max_steps={steps}",
        "trainer.checkpoint_every=5",
        f"mlflow.tracking_uri={store}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    sweep = _sweep(args, tmp_path, {"TF_CPU_BFC_MEM_LIMIT_IN_MB": "64"})
    _wait_for(sweep_dir / "2" / "checkpoints" / "checkpoint", sweep)  # job 3 under way
    sweep.kill()  # SIGKILL: the sweep's process does nothing more
    out, err = sweep.communicate(timeout=60)
    assert sweep.returncode == -signal.SIGKILL
    # Its job gets SIGTERM as its sweep dies: it ends its step, checkpoints and stops.
    _wait_gone(json.loads((sweep_dir / "2" / "run.json").read_text())["pid"])
    parent = json.loads((sweep_dir / SWEEP_FILE).read_text())["parent_run_id"]
    client = MlflowClient(tracking_uri=store)
    before = _by_job(client, parent)
    assert sorted(before) == ["0", "1", "2"]  # job 4 never started
    assert [r.info.status for r in (before["0"][0], before["1"][0], before["2"][0])] == [
        "FINISHED",
        "FAILED",
        "KILLED",
    ]
    # A failed isolated job is recorded, with its kind and error, and the sweep goes on.
    assert before["1"][0].data.tags["failure"] == "oom" and before["1"][0].data.tags["error"]
    assert "job 1 failed" in err
    assert "error: out of memory at optimizer step 1 with micro-batch" in err  # job 2's line
    # Under the same limit smaller micro-batches fit: job 1 finished with its peak logged, and
    # job 3, after job 2 ran out of memory, trained to its checkpoints (KILLED, not FAILED).
    assert before["0"][0].data.metrics["mem/peak_bytes"] > 0

    # Resumed on a machine with more memory: only the sweep directory is given.
    resumed = run_cli([f"sweep.resume={sweep_dir}"], tmp_path, None, 900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first, oom, killed = before["0"][0], before["1"][0], before["2"][0]
    assert f"job 0: its run {first.info.run_id} FINISHED: skipped" in resumed.stdout
    assert f"job 1: its run {oom.info.run_id} FAILED (oom): runs again" in resumed.stdout
    assert f"job 2: its run {killed.info.run_id} was stopped (KILLED): goes on" in resumed.stdout
    assert "job 3: it has no run yet: runs" in resumed.stdout

    after = _by_job(client, parent)
    assert sorted(after) == ["0", "1", "2", "3"]
    # Job 1 (number 0) was not run again: its one run, untouched.
    assert [r.info.run_id for r in after["0"]] == [first.info.run_id]
    assert after["0"][0].info.end_time == first.info.end_time
    # Job 3 went on in its own run, from its checkpoint: every step once.
    assert [r.info.run_id for r in after["2"]] == [killed.info.run_id]
    job3 = after["2"][0]
    assert int(job3.data.tags["resumed_from_step"]) >= 5
    losses = client.get_metric_history(job3.info.run_id, "train/loss")
    assert sorted(m.step for m in losses) == list(range(1, steps + 1))
    # Job 2 ran again in a new run; its failed attempt is kept, marked, and moved aside.
    assert [r.info.run_id for r in after["1"]] == [oom.info.run_id, after["1"][1].info.run_id]
    assert after["1"][0].info.status == "FAILED" and "superseded" in after["1"][0].data.tags
    assert (sweep_dir / "1" / ATTEMPTS / oom.info.run_id / "run.json").is_file()

    # 4 FINISHED children under the same parent, which the comparison covers once each.
    newest = sweep_runs(client, parent)
    assert [r.data.tags["job_num"] for r in newest] == ["0", "1", "2", "3"]
    assert all(r.info.status == "FINISHED" for r in newest)
    assert all(r.data.tags["mlflow.parentRunId"] == parent for r in newest)
    assert client.get_run(parent).info.status == "FINISHED"
    with open(sweep_dir / "comparison.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and all(row["status"] == "FINISHED" for row in table)


@pytest.mark.slow
@pytest.mark.parametrize("isolate", ["true", "false"])
def test_ctrl_c_stops_the_sweep_after_a_checkpoint_and_the_sweep_resumes(tmp_path, store, isolate):
    sweep_dir = tmp_path / "sweep"
    # The tiny model: its steps take milliseconds, and 290 of them after the first checkpoint
    # still leave the Ctrl-C seconds to arrive mid-job.
    args = [
        "-m",
        "accum=1,2",
        *TINY["transformer"],
        "data.batch_size=4",
        "data.train_samples=32",
        "data.val_samples=8",
        "trainer.progress=false",
        "trainer.max_steps=300",
        "trainer.checkpoint_every=10",
        f"sweep.isolate={isolate}",
        f"mlflow.tracking_uri={store}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    sweep = _sweep(args, tmp_path)
    _wait_for(sweep_dir / "0" / "checkpoints" / "checkpoint", sweep)
    sweep.send_signal(signal.SIGINT)  # Ctrl-C, as a terminal sends it to the sweep
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, err[-3000:]
    assert (
        f"sweep stopped by SIGINT during job 0; go on with: python run.py -m "
        f"sweep.resume={sweep_dir}" in err
    )
    assert not (sweep_dir / "1").exists()  # the next job did not start
    parent = json.loads((sweep_dir / SWEEP_FILE).read_text())["parent_run_id"]
    client = MlflowClient(tracking_uri=store)
    assert client.get_run(parent).info.status == "KILLED"
    (stopped,) = _by_job(client, parent)["0"]
    assert stopped.info.status == "KILLED" and "failure" not in stopped.data.tags
    if isolate == "true":
        # An isolated job stopped by a signal (KILLED, checkpointed) going on in its own run is
        # the resume of killed_during_job_3's job 3; what a resume does with the parent's stop
        # is the same in both ways of running jobs: checked once, below.
        return

    resumed = run_cli([f"sweep.resume={sweep_dir}"], tmp_path, None, 900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _by_job(client, parent)
    assert [r.info.run_id for r in after["0"]] == [stopped.info.run_id]
    assert [len(after[j]) for j in ("0", "1")] == [1, 1]
    runs = sweep_runs(client, parent)
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    steps = [m.step for m in client.get_metric_history(stopped.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 301))
    assert client.get_run(parent).info.status == "FINISHED"
    assert "stopped" not in client.get_run(parent).data.tags
    # The comparison says that the resumed job's figures cover its resumed steps only.
    start = int(client.get_run(stopped.info.run_id).data.tags["resumed_from_step"]) + 1
    note = f"baseline: resumed from a checkpoint; its figures cover optimizer steps {start}-300"
    assert note in resumed.stdout and note in (sweep_dir / "comparison.md").read_text()
