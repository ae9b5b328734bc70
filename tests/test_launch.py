"""runner.launch's own logic with real processes (no TensorFlow): who is stopped and when, the
launch's exit code, and its one-line errors. The workers' training is in test_distribution.py."""

import json
import subprocess
import sys
import time

import pytest

from runner import launch
from tests.conftest import run_launch


def _worker(code: int, after_s: float = 0.0) -> subprocess.Popen:
    """A stand-in worker process: it sleeps, then exits with `code`."""
    return subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; time.sleep({after_s}); sys.exit({code})"]
    )


def test_a_worker_stopped_by_a_signal_leaves_the_others_time_to_stop_after_the_same_step():
    # The chief stops 2 s after worker 1 (it had no signal: it learns of it and finishes its
    # step first); it is not killed, and the launch exits as a stopped job does.
    first, chief = _worker(143), _worker(143, after_s=2)
    assert launch.wait([chief, first]) == 143
    assert chief.returncode == 143  # its own exit, not SIGTERM's (-15)


def test_a_failed_worker_stops_the_others_at_once():
    failed, waiting = _worker(1), _worker(0, after_s=60)
    start = time.monotonic()
    assert launch.wait([waiting, failed]) == 1  # the failure's code, not the stopped one's
    assert time.monotonic() - start < 30
    assert waiting.returncode == -15


def test_a_stopped_worker_whose_peers_hang_gets_them_stopped(monkeypatch):
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1)
    stopped, hanging = _worker(143), _worker(0, after_s=60)
    assert launch.wait([hanging, stopped]) == 143  # SIGTERM's 128 + 15 for the hung one
    assert hanging.returncode == -15


def test_resume_goes_on_with_every_worker_of_the_launch(tmp_path):
    for i in range(3):
        (tmp_path / f"worker{i}").mkdir()
        (tmp_path / f"worker{i}" / "run.json").write_text(json.dumps({"job": "x"}))
    assert launch.launched_workers(tmp_path) == 3
    args = launch.resume_args(tmp_path, 2, "now")
    assert args[-2:] == [
        f"trainer.resume={tmp_path / 'worker2'}",
        f"hydra.run.dir={tmp_path / 'worker2' / 'resumed' / 'now'}",
    ]


@pytest.mark.parametrize(
    "args, named",
    [
        (["--workers", "1", "--dir", "{tmp}/launch", "--", "accum=2"], "--workers=1"),
        (["--dir", "{tmp}/launch", "--", "precision=mixd"], "precision=mixd"),
        (["--resume", "{tmp}"], "--resume={tmp}"),  # no worker<i>/run.json there
    ],
    ids=["one-worker", "bad-override", "resume-not-a-launch"],
)
def test_bad_input_gets_one_line_before_any_worker_starts(tmp_path, args, named):
    result = run_launch(*[a.format(tmp=tmp_path) for a in args], timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named.format(tmp=tmp_path) in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []  # no launch folder, no worker
