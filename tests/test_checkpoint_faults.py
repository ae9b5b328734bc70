"""Checkpoint faults (issue 27): a damaged newest checkpoint, a full disk. Real TensorFlow, a
real SQLite store, a real signal, a real small filesystem (tmpfs in a user namespace) and
/dev/full (ENOSPC on every write)."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf
from mlflow.tracking import MlflowClient

from runner.config import compose_config
from runner.core.errors import Interrupted
from runner.track.client import scratch_store
from tests.conftest import REPO, tiny_overrides

STEPS = 4
TRUNCATED = "IndexError: Read less bytes than requested"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, Path]:
    """A run stopped by a real SIGTERM (sent while step 3 was saved) after its last step, 4:
    ckpt-3 and ckpt-4 kept, the run KILLED. Returns its folder (store) and run directory."""
    from runner.train import run
    from runner.train.checkpoint import TrainState

    folder = tmp_path_factory.mktemp("stopped")
    store = scratch_store(folder)
    save = TrainState.save

    def save_then_signal(state, step):
        path = save(state, step)
        if step == STEPS - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the run: it stops after step 4
        return path

    overrides = [f"trainer.max_steps={STEPS}", "trainer.checkpoint_every=1"]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)  # outside Hydra the run directory is ./outputs/runs/<run id>
        patch.setattr(TrainState, "save", save_then_signal)
        with pytest.raises(Interrupted):
            run(compose_config(tiny_overrides("transformer", store) + overrides))
    (run_dir,) = (folder / "outputs" / "runs").iterdir()
    return folder, run_dir


def _copy(stopped, tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    """This test's own copy of the stopped run: its store and run directory (run.json pointed
    at the copied store). Returns the store, the run directory and the run's id. The test
    runs in the stopped run's folder, whose outputs/ holds the CPU's calibrated peak FLOP/s
    (runner.report.figures.CACHE_DIR): a new folder would calibrate it again (seconds)."""
    folder, run_dir = stopped
    monkeypatch.chdir(folder)
    shutil.copy(folder / "mlflow.db", tmp_path / "mlflow.db")
    store = f"sqlite:///{tmp_path}/mlflow.db"
    copy = Path(shutil.copytree(run_dir, tmp_path / "run"))
    record = json.loads((copy / "run.json").read_text())
    record["tracking_uri"] = record["config"]["mlflow"]["tracking_uri"] = store
    (copy / "run.json").write_text(json.dumps(record))
    return store, copy, record["run_id"]


def _truncate(checkpoints: Path, name: str) -> None:
    data = checkpoints / f"{name}.data-00000-of-00001"
    os.truncate(data, data.stat().st_size // 2)  # a copy gone wrong


def _steps_done(checkpoint: str) -> int:
    """The checkpoint's step, every tensor of it read back (sizes and checksums checked)."""
    reader = tf.train.load_checkpoint(checkpoint)
    dtypes = reader.get_variable_to_dtype_map()
    tensors = {n: reader.get_tensor(n) for n, t in dtypes.items() if t != tf.variant}
    return int(next(v for n, v in tensors.items() if n.startswith("steps_done")))


def _resume(store: str, run_dir: Path):
    """`python run.py trainer.resume=<run dir>`'s job, in this process: run.py's one-line
    errors included (SystemExit)."""
    from run import _one_job

    _one_job(compose_config([*tiny_overrides("transformer", store), f"trainer.resume={run_dir}"]))


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_goes_on_from_the_one_before(
    stopped, tmp_path, monkeypatch, capsys
):
    store, run_dir, run_id = _copy(stopped, tmp_path, monkeypatch)
    client = MlflowClient(tracking_uri=store)
    assert client.get_run(run_id).info.status == "KILLED"
    checkpoints = run_dir / "checkpoints"
    _truncate(checkpoints, "ckpt-4")  # the last step's: intact, the run would be finished
    _resume(store, run_dir)
    out, err = capsys.readouterr()
    assert (
        f"tfmemlab: checkpoint ckpt-4 in {checkpoints} does not restore ({TRUNCATED}); "
        "going on from ckpt-3\n"
    ) in err
    assert f"resumed after optimizer step 3 from {run_dir}" in out
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["resumed_from_step"] == "3"
    # Step 4 ran again: none of its metrics (train/loss, val/loss, ...) is logged twice.
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), key
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert steps == list(range(1, STEPS + 1))
    assert [m.step for m in client.get_metric_history(run_id, "val/loss")] == [STEPS]
    # The damaged files are kept aside, and the step-4 checkpoint was written again, whole.
    assert sorted(p.name for p in (checkpoints / "damaged").iterdir()) == [
        "ckpt-4.data-00000-of-00001",
        "ckpt-4.index",
    ]
    assert _steps_done(str(checkpoints / "ckpt-4")) == STEPS
    assert tf.train.latest_checkpoint(str(checkpoints)) == str(checkpoints / "ckpt-4")


def test_no_checkpoint_that_restores_is_one_line_and_leaves_the_run_as_it_was(
    stopped, tmp_path, monkeypatch, capsys
):
    store, run_dir, run_id = _copy(stopped, tmp_path, monkeypatch)
    checkpoints = run_dir / "checkpoints"
    _truncate(checkpoints, "ckpt-4")
    _truncate(checkpoints, "ckpt-3")
    with pytest.raises(SystemExit) as stop:
        _resume(store, run_dir)
    assert str(stop.value.code) == (
        f"error: no checkpoint in {checkpoints} restores (the damaged ones are in "
        f"{checkpoints / 'damaged'}); the run cannot go on: start the job again"
    )  # a message: Python exits with 1
    err = capsys.readouterr().err
    assert f"checkpoint ckpt-3 in {checkpoints} does not restore ({TRUNCATED}); none" in err
    run = MlflowClient(tracking_uri=store).get_run(run_id)
    assert run.info.status == "KILLED" and "failure" not in run.data.tags  # the job did not fail


def test_a_report_write_on_a_full_disk_is_disk_full_not_a_traceback(stopped, tmp_path, monkeypatch):
    """metrics.json pointed at /dev/full, whose every write fails with ENOSPC."""
    store, run_dir, run_id = _copy(stopped, tmp_path, monkeypatch)
    _truncate(run_dir / "checkpoints", "ckpt-4")  # so that step 4 runs again, then the report
    (run_dir / "metrics.json").symlink_to("/dev/full")
    with pytest.raises(SystemExit) as stop:
        _resume(store, run_dir)
    line = str(stop.value.code)
    assert line.startswith(
        f"error: disk full: writing {run_dir / 'metrics.json'} failed (No space left on device); "
    )
    assert line.endswith(" MiB left on that filesystem") and "\n" not in line
    run = MlflowClient(tracking_uri=store).get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["failure"] == "disk_full"


def test_a_full_disk_while_checkpointing_is_disk_full_and_keeps_the_last_checkpoint(
    stopped, tmp_path
):
    """The run directory on a tmpfs with room for one checkpoint of the tiny model (about 70 KiB)
    but not two: the second SaveV2 fails with ENOSPC (a ResourceExhaustedError)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed: no tmpfs without root")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no user and mount namespace here: {probe.stderr.strip()}")
    small, kept = tmp_path / "small", tmp_path / "kept"
    small.mkdir()
    store = f"sqlite:///{tmp_path}/mlflow.db"  # outside the small filesystem, like the cwd
    args = [
        *tiny_overrides("transformer", store),
        "trainer.max_steps=20",
        "trainer.checkpoint_every=1",
        f"hydra.run.dir={small}/run",
    ]
    command = " ".join([sys.executable, str(REPO / "run.py"), *args])
    script = (
        f"mount -t tmpfs -o size=3m tmpfs {small} && "
        f"head -c {3 * 2**20 - 140 * 2**10} /dev/zero > {small}/filler && "
        f"{{ {command}; rc=$?; cp -a {small}/run {kept}; exit $rc; }}"
    )
    result = subprocess.run(  # in the stopped run's folder: its calibrated CPU peak (_copy)
        ["unshare", "-rm", "sh", "-c", script], cwd=stopped[0], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "out of memory" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    run_dir, checkpoints = small / "run", small / "run" / "checkpoints"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"error: disk full: writing {checkpoints}/ckpt-2 failed (No space left on device); "
    ), last
    assert last.endswith(
        f" MiB left on that filesystem. The last good checkpoint, {checkpoints}/ckpt-1, is kept: "
        f"free space, then python run.py trainer.resume={run_dir}"
    ), last
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["failure"] == "disk_full"
    assert _steps_done(str(kept / "checkpoints" / "ckpt-1")) == 1
    assert not list((kept / "checkpoints").glob("*_temp"))  # the half-written one removed
