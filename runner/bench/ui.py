"""python -m runner.bench ui: what the MLflow UI costs, started as tfmemlab prints it against
plain `mlflow ui` (issue 48), side by side on one store.

MLflow 3's server starts a job runner for its GenAI features (huey worker processes beside the
server) unless MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false, and 4 uvicorn workers unless told
`--workers`; runs of tfmemlab need none of the first, and one user needs one worker. Each
UI is started on a free port of 127.0.0.1 over a copy of one empty store, waited for until it
answers /health and then `--settle` seconds more (its workers start after the server answers),
and measured as the resident memory (RSS) of its whole process tree, counted by psutil, and the
number of processes in it. Then the tree is stopped.
"""

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from runner.core.text import table
from runner.track.client import UI_ENV, scratch_store, ui_hint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(pid: int) -> list[psutil.Process]:
    """The process and every descendant of it still alive."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_rss(pid: int) -> tuple[int, int]:
    """(bytes resident in the tree, processes in it)."""
    total, count = 0, 0
    for proc in tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
            count += 1
    return total, count


def start_ui(command: str, port: int) -> subprocess.Popen:
    """`command` (a shell line, `VAR=value mlflow ui ...`) on `port`, in its own process group,
    once it answers /health (at most 120 s)."""
    words = shlex.split(command)
    env = dict(os.environ)
    while "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    proc = subprocess.Popen(
        [*words, "--host", "127.0.0.1", "--port", str(port)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    for _ in range(240):
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc
        time.sleep(0.5)
    stop_ui(proc)
    raise RuntimeError(f"the UI did not answer within 120 s: {command}")


def stop_ui(proc: subprocess.Popen) -> None:
    """The UI's whole process group (the CLI, its server and any workers), and its wait."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def measure(command: str, settle: float) -> tuple[int, int]:
    """(tree RSS, processes) of the UI `command`, `settle` seconds after it answered."""
    proc = start_ui(command, _free_port())
    try:
        time.sleep(settle)
        return tree_rss(proc.pid)
    finally:
        stop_ui(proc)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m runner.bench ui")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after /health")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        uri = scratch_store(Path(folder))
        printed, _ = ui_hint(uri, "0")
        plain = f"mlflow ui --backend-store-uri {uri}"
        jobs = [
            ("as tfmemlab prints it", printed),
            ("job runner off, 4 workers", f"{UI_ENV} {plain}"),
            ("plain mlflow ui", plain),
        ]
        rows, figures = [], {}
        for name, command in jobs:
            rss, count = measure(command, args.settle)
            figures[name] = rss
            rows.append({"UI": name, "processes": count, "RSS_MiB": round(rss / 2**20)})
    print(f"== the MLflow UI's process tree, {args.settle:g} s after it answered")
    print(table(rows, ["UI", "processes", "RSS_MiB"]))
    ratio = figures["as tfmemlab prints it"] / figures["plain mlflow ui"]
    print(f"as printed / plain: RSS {ratio:.3f}x")
