"""Checkpoints, resume and signals (issue 16): real processes, real signals, a real store."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from mlflow.tracking import MlflowClient

from tests.conftest import MEMORY_BOUND, REPO, run_cli, tiny_overrides

STEPS = 60


def _job(store: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        *tiny_overrides("transformer", store),
        f"trainer.max_steps={STEPS}",
        "trainer.checkpoint_every=3",
        "trainer.deterministic=true",
        "model.dropout=0.1",  # the dropout seed generators' states must be restored too
        "data.train_samples=64",  # several epochs of shuffling: the iterator's state matters
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def _start(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def final_state(run_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the run's last checkpoint but the bookkeeping, by name."""
    reader = tf.train.load_checkpoint(str(run_dir / "checkpoints"))
    names = reader.get_variable_to_shape_map()
    skip = ("_CHECKPOINTABLE", "save_counter", "iterator")  # its prefetch buffer varies
    return {n: reader.get_tensor(n) for n in names if not n.startswith(skip)}


def _run(store: str):
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
    return client, run


# Accumulation, float16 loss scaling and pruning's masks in one job: every piece of state a
# checkpoint holds must be restored for the resumed run to end bitwise equal.
TECHNIQUES = ["accum=2", "precision=mixed", "pruning=polynomial", "pruning.frequency=4"]


@pytest.mark.slow
def test_a_run_killed_at_a_random_step_resumes_bitwise_equal(tmp_path, store):
    run_dir = tmp_path / "killed"
    job = _start(_job(store, run_dir, *TECHNIQUES), tmp_path)
    index = run_dir / "checkpoints" / "checkpoint"
    deadline = time.monotonic() + 300
    while not index.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(random.uniform(0.0, 0.3))  # some steps after the checkpoint, some not
    job.kill()  # SIGKILL: nothing runs after it
    job.communicate(timeout=60)
    assert job.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    client, killed = _run(store)
    assert killed.info.status == "RUNNING"  # what MLflow leaves after a SIGKILL
    run_id = killed.info.run_id

    # The next start of the same job finds the lost run, says how to go on, and closes it;
    # it then runs the whole job uninterrupted: the reference the resumed run must equal.
    whole = tmp_path / "whole"
    again = _start(_job(store, whole, *TECHNIQUES), tmp_path)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    assert f"run {run_id} of this job was left RUNNING by process {job.pid}" in err
    assert f"python run.py trainer.resume={run_dir}" in err
    assert client.get_run(run_id).info.status == "KILLED"

    # Two resumes started together (issue 27): one goes on; the other changes nothing and says
    # which process has the run directory.
    env = {"MLFLOW_TRACKING_URI": store}
    both = [_start([f"trainer.resume={run_dir}"], tmp_path, env) for _ in range(2)]
    outputs = [process.communicate(timeout=600) for process in both]
    ran = [i for i, process in enumerate(both) if process.returncode == 0]
    assert len(ran) == 1, [err[-2000:] for _, err in outputs]
    (winner,), loser = ran, 1 - ran[0]
    assert both[loser].returncode != 0 and "Traceback" not in outputs[loser][1]
    assert (
        outputs[loser][1]
        .strip()
        .splitlines()[-1]
        .startswith(
            f"error: trainer.resume={run_dir}: held by process {both[winner].pid} on host "
            f"{socket.gethostname()} (started "
        )
    )
    resumed = subprocess.CompletedProcess([], 0, *outputs[winner])
    run = client.get_run(run_id)  # the same run, finished
    assert run.info.status == "FINISHED"
    start = int(run.data.tags["resumed_from_step"])
    assert 3 <= start < STEPS and start % 3 == 0
    assert f"resumed after optimizer step {start}" in resumed.stdout
    # Each step's loss once, every step: none lost, none logged twice.
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, STEPS + 1))

    expected, got = final_state(whole), final_state(run_dir)
    assert expected.keys() == got.keys() and len(got) > 10
    assert any(n.startswith("masks") for n in got)  # pruning's masks are in the state
    different = [n for n in expected if not np.array_equal(expected[n], got[n])]
    assert not different, different  # bitwise


def test_each_checkpoint_is_written_after_the_metrics_of_its_steps(
    tiny_cfg, store, tmp_path, monkeypatch
):
    """Metrics first, then the checkpoint: a kill between the two then costs steps that run
    again (and are not logged twice), not steps lost for good. The kill test above lands in
    that gap only by chance; here the store is read as each checkpoint is about to be saved."""
    from runner.train import run
    from runner.train.checkpoint import TrainState

    monkeypatch.chdir(tmp_path)  # outside Hydra the run directory is ./outputs/runs/<run id>
    client, saved, save = MlflowClient(tracking_uri=store), {}, TrainState.save

    def save_reading_the_store(state, step):
        (run,) = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
        losses = client.get_metric_history(run.info.run_id, "train/loss")
        saved[step] = sorted(m.step for m in losses)
        return save(state, step)

    monkeypatch.setattr(TrainState, "save", save_reading_the_store)
    run(tiny_cfg("transformer", "trainer.max_steps=7", "trainer.checkpoint_every=3"))
    assert saved == {3: [1, 2, 3], 6: list(range(1, 7)), 7: list(range(1, 8))}


def _wait_for_logged_steps(store: str, run_dir: Path, job: subprocess.Popen) -> None:
    """Until the run's first batch of step metrics is in the store: steps are under way."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.poll() is None:
        if (run_dir / "run.json").exists():  # the store exists: reading it creates nothing
            client, run = _run(store)
            if client.get_metric_history(run.info.run_id, "train/loss"):
                return
        time.sleep(0.2)
    pytest.fail("no step was logged")


@pytest.mark.slow
@pytest.mark.parametrize("trains", [False, True], ids=["while-it-starts", "while-it-trains"])
def test_sigterm_finishes_the_step_checkpoints_and_marks_the_run_killed(tmp_path, store, trains):
    run_dir = tmp_path / "run"
    args = [*tiny_overrides("transformer", store), "trainer.max_steps=100000"]
    job = _start([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    deadline = time.monotonic() + 300
    while not (run_dir / "run.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if trains:  # else: TensorFlow still loading
        _wait_for_logged_steps(store, run_dir, job)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 143, err[-3000:]
    assert f"go on with: python run.py trainer.resume={run_dir}" in out
    client, run = _run(store)
    assert run.info.status == "KILLED" and "failure" not in run.data.tags
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps and sorted(steps) == list(range(1, max(steps) + 1))
    reader = tf.train.load_checkpoint(str(run_dir / "checkpoints"))  # complete: it loads
    done = [n for n in reader.get_variable_to_shape_map() if n.startswith("steps_done")]
    assert int(reader.get_tensor(done[0])) == max(steps)  # the step it finished, saved


def test_resume_of_something_that_is_not_a_run_is_a_one_line_error(tmp_path):
    result = run_cli([f"trainer.resume={tmp_path}"], tmp_path, None, 60)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: trainer.resume={tmp_path}: no run.json there; expected a run directory"
    )
    finished = tmp_path / "finished"
    (finished / "checkpoints").mkdir(parents=True)
    (finished / "checkpoints" / "checkpoint").write_text('model_checkpoint_path: "ckpt-3"\n')
    record = {"run_id": "x", "tracking_uri": "sqlite:///x.db", "job": "default"}
    config = {"trainer": {"max_steps": 3}}
    (finished / "run.json").write_text(json.dumps({**record, "config": config}))
    result = run_cli([f"trainer.resume={finished}"], tmp_path, None, 60)
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: trainer.resume={finished}: that run finished all its 3 optimizer steps; "
        "nothing is left to resume"
    )
    result = run_cli(["trainer.resume=latest", "accum=3"], tmp_path, None, 60)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "error: trainer.resume=latest: no run directory of the job 'accum=3'" in result.stderr


def test_a_nan_loss_fails_the_run_and_keeps_the_last_checkpoint(
    tiny_cfg, store, monkeypatch, tmp_path
):
    from runner.train import run

    monkeypatch.chdir(tmp_path)  # outside Hydra the run directory is ./outputs/runs/<run id>
    cfg = tiny_cfg(
        "transformer",
        "trainer.max_steps=50",
        "trainer.checkpoint_every=1",
        "trainer.optimizer=sgd",
        "trainer.lr=1e12",  # diverges within a few steps
    )
    with pytest.raises(FloatingPointError):
        run(cfg)
    client, failed = _run(store)
    assert failed.info.status == "FAILED" and failed.data.tags["failure"] == "nan"
    losses = client.get_metric_history(failed.info.run_id, "train/loss")
    bad = min(m.step for m in losses if not np.isfinite(m.value))
    reader = tf.train.load_checkpoint(str(Path(failed.data.tags["run_dir"]) / "checkpoints"))
    done = [n for n in reader.get_variable_to_shape_map() if n.startswith("steps_done")]
    assert int(reader.get_tensor(done[0])) == bad - 1  # the last finite step, not the NaN one


def test_a_reopened_run_logs_no_metric_at_a_step_it_already_has(tmp_path, store):
    from runner.config import compose_config
    from runner.track.lifecycle import mlflow_run

    cfg = compose_config(tiny_overrides("transformer", store))
    with mlflow_run(cfg, "job") as tracker:  # flushed steps 1-10, as before a kill
        for step in range(1, 11):
            tracker.log_metrics({"train/loss": float(step)}, step)
        tracker.log_metrics({"val/loss": 1.0}, 4)
    # Resumed from a checkpoint at step 6: steps 7-10 run again, and the run goes on.
    with mlflow_run(cfg, "job", resume_run_id=tracker.run_id) as again:
        for step in range(7, 13):
            again.log_metrics({"train/loss": float(step), "val/loss": 2.0}, step)
    client = MlflowClient(tracking_uri=store)
    losses = client.get_metric_history(tracker.run_id, "train/loss")
    assert sorted(m.step for m in losses) == list(range(1, 13))
    assert sorted(m.step for m in client.get_metric_history(tracker.run_id, "val/loss")) == [
        4,
        7,
        8,
        9,
        10,
        11,
        12,
    ]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


@pytest.mark.slow  # one fresh process: 37 s of wall time under load
def test_out_of_memory_fails_the_run_with_its_levers_in_one_line_and_no_checkpoint(tmp_path, store):
    """A plain run, one fresh process (the BFC limit is read when TensorFlow starts). That a
    sweep goes on after such a job and that a smaller micro-batch then fits under the same
    limit: test_sweep_resume's killed_during_job_3 (its job 2 runs out of memory)."""
    run_dir = tmp_path / "run"
    result = run_cli(
        [
            "data.batch_size=256",  # 145 MiB asked for at 256
            *MEMORY_BOUND,
            "trainer.max_steps=2",
            "trainer.checkpoint_every=1",
            f"mlflow.tracking_uri={store}",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        {"TF_CPU_BFC_MEM_LIMIT_IN_MB": "64"},
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    _, oom = _run(store)
    assert oom.info.status == "FAILED" and oom.data.tags["failure"] == "oom"
    error = oom.data.tags["error"]
    assert "out of memory at optimizer step 1 with micro-batch data.batch_size=256" in error
    assert "against a limit of 64 MiB" in error and "accum=2 data.batch_size=128" in error
    (line,) = [s for s in result.stderr.splitlines() if "out of memory" in s]  # one line
    assert line.startswith("error: out of memory at optimizer step 1")
    assert not (run_dir / "checkpoints").exists()  # nothing from that state


def test_a_run_killed_before_its_first_checkpoint_is_to_run_again_and_is_marked_killed(
    tmp_path, store
):
    """While it runs a resume is refused (issue 27); once SIGKILLed with no checkpoint, a
    resume says to run it again and closes its MLflow run, found by run.json or, when run.json
    was never written, by its run_dir tag. The command line is checked in this process: its
    one line is the SystemExit's message (run.py prints it as is)."""
    from runner.cli import check_command_line

    run_dir = tmp_path / "run"
    args = [*tiny_overrides("transformer", store), "trainer.max_steps=100000"]
    job = _start([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    deadline = time.monotonic() + 300
    while not (run_dir / "run.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(SystemExit) as held:
        check_command_line([f"trainer.resume={run_dir}"])
    assert str(held.value).startswith(
        f"error: trainer.resume={run_dir}: held by process {job.pid} on host "
    )
    job.kill()  # SIGKILL: no checkpoint, the run left RUNNING
    job.communicate(timeout=60)
    client, run = _run(store)
    assert run.info.status == "RUNNING"

    # The overrides in the order given: trainer.max_steps is given twice, and the last wins.
    again = f"run it again with: python run.py {' '.join(args)}"
    with pytest.raises(SystemExit) as stopped:
        check_command_line([f"trainer.resume={run_dir}"])
    assert str(stopped.value) == (
        f"error: trainer.resume={run_dir}: the run there was stopped before its first "
        f"checkpoint (it wrote no checkpoint): there is nothing to go on from; {again}"
    )
    run = client.get_run(run.info.run_id)
    assert run.info.status == "KILLED" and f"process {job.pid}" in run.data.tags["lost"]

    # Killed before run.json was written: the run is found by its run_dir tag.
    client.update_run(run.info.run_id, status="RUNNING")
    (run_dir / "run.json").unlink()
    with pytest.raises(SystemExit) as stopped:
        check_command_line([f"trainer.resume={run_dir}"])
    assert str(stopped.value).endswith(again)
    assert client.get_run(run.info.run_id).info.status == "KILLED"
