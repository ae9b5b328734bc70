"""One process at a time in a folder (issue 27): real processes holding the lock, real SIGKILL,
records written as another host would write them."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.core import lock
from runner.core.errors import BusyError
from runner.core.lock import LOCK_FILE, STALE_S, FolderLock
from runner.sweep.resume import plan_job, resume_argv
from runner.sweep.state import write_sweep_file
from tests.conftest import REPO, run_cli

HOLD = """
import sys, time
from runner.core.lock import FolderLock
with FolderLock(sys.argv[1], "x"):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(folder: Path) -> subprocess.Popen:
    """A real process that takes `folder`'s lock and keeps it."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    return process


def _write_record(folder: Path, **record) -> None:
    """A lock record as its holder writes it, without the flock (another host, or a file
    system where flock does nothing)."""
    folder.mkdir(parents=True, exist_ok=True)
    fields = {"pid": 4321, "host": socket.gethostname(), "started": "2026-01-01 00:00:00"}
    (folder / LOCK_FILE).write_text(json.dumps({**fields, **record}))


def test_a_holder_killed_by_sigkill_does_not_block_the_next_taker(tmp_path):
    holder = _holder(tmp_path)
    with pytest.raises(BusyError) as busy, FolderLock(tmp_path, f"trainer.resume={tmp_path}"):
        pass
    assert str(busy.value).startswith(
        f"trainer.resume={tmp_path}: held by process {holder.pid} on host {socket.gethostname()}"
    )
    assert str(busy.value).endswith("; wait for it to end, or stop it")
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # left behind
    with FolderLock(tmp_path, "x"):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert lock.holder(tmp_path) is None  # released: free again


def test_a_stopped_holder_whose_heartbeat_went_stale_still_holds_on_this_host(tmp_path):
    """Ctrl-Z: its heartbeat stops, but its flock stays, and the kernel's word wins here."""
    holder = _holder(tmp_path)
    holder.send_signal(signal.SIGSTOP)
    try:
        record = lock.read_record(tmp_path)
        _write_record(tmp_path, **{**record, "heartbeat": time.time() - STALE_S - 1})
        with (
            pytest.raises(BusyError, match=f"held by process {holder.pid} "),
            FolderLock(tmp_path, "x"),
        ):
            pass
    finally:
        holder.kill()
        holder.wait()


def test_without_flock_a_live_pid_on_this_host_holds_and_a_dead_one_does_not(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        _write_record(tmp_path, pid=alive.pid, heartbeat=time.time())
        with (
            pytest.raises(BusyError, match=f"held by process {alive.pid} "),
            FolderLock(tmp_path, "x"),
        ):
            pass
    finally:
        alive.kill()
        alive.wait()
    with FolderLock(tmp_path, "x"):  # the same record, its process gone
        pass


def test_a_record_from_another_host_holds_while_its_heartbeat_is_fresh(tmp_path):
    _write_record(tmp_path, pid=1, host="other-host", heartbeat=time.time())
    with (
        pytest.raises(BusyError, match="held by process 1 on host other-host"),
        FolderLock(tmp_path, "x"),
    ):
        pass
    _write_record(tmp_path, pid=1, host="other-host", heartbeat=time.time() - STALE_S - 1)
    with FolderLock(tmp_path, "x"):
        pass


def test_the_holder_refreshes_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    with FolderLock(tmp_path, "x"):
        first = lock.read_record(tmp_path)["heartbeat"]
        time.sleep(0.5)
        assert lock.read_record(tmp_path)["heartbeat"] > first


def _files(folder: Path) -> dict:
    """Every file under `folder` and its bytes, but the lock's (its heartbeat moves)."""
    return {
        p.relative_to(folder): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and p.name != LOCK_FILE
    }


def test_a_second_sweep_resume_of_a_held_sweep_says_so_in_one_line_and_moves_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    write_sweep_file(
        sweep, "parent", f"sqlite:///{tmp_path}/mlflow.db", "tfmemlab", ["accum=1,2"], []
    )
    (sweep / "0").mkdir()
    record = {"run_id": "r", "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "job": "accum=1"}
    (sweep / "0" / "run.json").write_text(json.dumps(record))
    holder = _holder(sweep)  # the sweep that runs, or the first sweep.resume
    before = _files(sweep)
    try:
        with pytest.raises(SystemExit) as early:  # before Hydra starts, not only in its callback
            resume_argv(["-m", f"sweep.resume={sweep}"])
        result = run_cli(["-m", f"sweep.resume={sweep}"], tmp_path, None, 120)
        # A new sweep into the same folder (two started in the same second): its callback.
        store = f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"
        new = run_cli(["-m", "accum=1,2", f"hydra.sweep.dir={sweep}", store], tmp_path, None, 120)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: sweep.resume={sweep}: held by process {holder.pid} on host "
        f"{socket.gethostname()} (started {lock.read_record(sweep)['started']}); wait for it to "
        "end, or stop it"
    ]
    assert str(early.value) == result.stderr.strip()
    job = _holder(sweep / "0")  # a trainer.resume of job 0's folder: the sweep leaves it alone
    try:
        assert plan_job(sweep / "0").action == "busy"
    finally:
        job.kill()
        job.wait()
    assert new.returncode != 0 and new.stderr.strip().splitlines() == [
        result.stderr.strip().replace(f"sweep.resume={sweep}", f"hydra.sweep.dir={sweep}")
    ]
    assert _files(sweep) == before
    assert not (tmp_path / "mlflow.db").exists()  # MLflow was not even opened


def test_processes_started_in_the_same_second_each_get_a_folder_of_their_own(tmp_path):
    # Hydra names run and sweep folders by the second (conf/config.yaml): the resolver gives
    # a second process that asks for the same name its own folder, and one process the same
    # answer every time it asks.
    base = str(tmp_path / "outputs" / "runs" / "12-00-00")
    code = (
        "import sys; from runner.core.lock import fresh_dir; "
        "print(fresh_dir(sys.argv[1]), fresh_dir(sys.argv[1]))"
    )
    answers = [
        subprocess.run(
            [sys.executable, "-c", code, base], cwd=REPO, capture_output=True, text=True
        ).stdout.split()
        for _ in range(3)
    ]
    assert [a[0] for a in answers] == [base, f"{base}-2", f"{base}-3"]
    assert all(a[0] == a[1] for a in answers)
    assert all(Path(a[0]).is_dir() for a in answers)
