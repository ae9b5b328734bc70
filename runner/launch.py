"""`python -m runner.launch --workers 2 -- <run.py overrides>`: a multi-worker job on this machine.

It starts N `run.py` processes with `distribution=multi_worker`, each with a TF_CONFIG naming
all of them on 127.0.0.1 ports, and waits for them. It is for trying multi-worker training on
one machine: on a cluster, the cluster's own launcher starts the workers (SLURM's srun, read by
SlurmClusterResolver; or anything that sets TF_CONFIG). Worker 0 is the chief: it logs the
job's one MLflow run and prints to this terminal; the other workers' output goes to
worker<i>.log in the launch folder, and each worker keeps its run directory there.

If a worker fails the others are stopped (their collectives would wait for it forever), and
the launch exits with the failed worker's code. Ctrl-C or SIGTERM is passed on to every worker.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

RUN_PY = Path(__file__).resolve().parent.parent / "run.py"


def free_ports(count: int) -> list[int]:
    """Ports the system says are free now, all held open together so that they differ."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(ports: list[int], index: int) -> str:
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def worker_args(overrides: list[str], folder: Path, index: int) -> list[str]:
    """run.py's arguments for worker `index`: the user's overrides, multi_worker, and a run
    directory of its own under `folder`."""
    args = [o for o in overrides if not o.startswith(("distribution=", "hydra.run.dir="))]
    return [
        sys.executable,
        str(RUN_PY),
        "distribution=multi_worker",
        *args,
        f"hydra.run.dir={folder / f'worker{index}'}",
    ]


def _stop(workers: list[subprocess.Popen], sig: int) -> None:
    for w in workers:
        if w.poll() is None:
            w.send_signal(sig)


def wait(workers: list[subprocess.Popen]) -> int:
    """Wait for every worker; the first to fail stops the others. The launch's exit code."""
    received: list[int] = []

    def pass_on(signum, frame) -> None:
        received.append(signum)
        _stop(workers, signal.SIGTERM if len(received) == 1 else signal.SIGKILL)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(w.poll() is None for w in workers):
            failed = [w for w in workers if w.poll() not in (None, 0)]
            if failed:
                _stop(workers, signal.SIGTERM)
                for w in workers:
                    try:
                        w.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        w.kill()
                break
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [w.wait() for w in workers]
    return next((c for c in codes if c != 0), 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runner.launch",
        description="Start N local workers of one multi-worker job (distribution=multi_worker).",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (>= 2)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="launch folder (default outputs/launch/<time>)"
    )
    parser.add_argument("overrides", nargs="*", help="run.py overrides, after --")
    args = parser.parse_args(argv)
    if args.workers < 2:
        print(f"error: --workers={args.workers}: expected an integer >= 2", file=sys.stderr)
        return 2
    # The command line is checked once, before any worker starts (one line, no TensorFlow).
    from runner.cli import check_command_line

    check_command_line(["distribution=multi_worker", *args.overrides])
    folder = args.dir or Path("outputs") / "launch" / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    folder.mkdir(parents=True, exist_ok=True)
    ports = free_ports(args.workers)
    workers = []
    for i in range(args.workers):
        env = {**os.environ, "TF_CONFIG": tf_config(ports, i)}
        log = None if i == 0 else open(folder / f"worker{i}.log", "w")  # noqa: SIM115
        workers.append(
            subprocess.Popen(
                worker_args(args.overrides, folder, i),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
            )
        )
    print(
        f"tfmemlab: launch: {args.workers} workers on 127.0.0.1 ports "
        f"{', '.join(map(str, ports))}; worker 0 (the chief) below, the others in "
        f"{folder}/worker<i>.log",
        flush=True,
    )
    code = wait(workers)
    if code:
        print(f"tfmemlab: launch: a worker failed (exit {code}); see {folder}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
