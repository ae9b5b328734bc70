"""`python -m runner.launch --workers 2 -- <run.py overrides>`: a multi-worker job on this machine.

It starts N `run.py` processes with `distribution=multi_worker`, each with a TF_CONFIG naming
all of them on 127.0.0.1 ports, and waits for them. It is for trying multi-worker training on
one machine: on a cluster, the cluster's own launcher starts the workers (SLURM's srun, read by
SlurmClusterResolver; or anything that sets TF_CONFIG). Worker 0 is the chief: it logs the
job's one MLflow run and prints to this terminal; the other workers' output goes to
worker<i>.log in the launch folder, and each worker keeps its run directory there.

If a worker fails the others are stopped (their collectives would wait for it forever), and
the launch exits with the failed worker's code. Ctrl-C or SIGTERM is passed on to every worker;
a SIGTERM that reaches one worker alone (a preempted machine) stops all of them after the same
optimizer step, each with its checkpoint (runner.techniques.distribution.WorkersStop).
`python -m runner.launch --resume <launch folder>` goes on from there: every worker resumes
its own run directory, and the chief its MLflow run.

The workers run in a private network namespace whose only interface is loopback
(runner.core.netns): TensorFlow's servers listen on every interface whatever TF_CONFIG says,
and answer anyone, unauthenticated (tensorflow/tensorflow#11689). There a tracking server
cannot be reached, so a launch that logs to one is refused, as is a launch on a system that
cannot make the namespace, unless `--allow-network` runs the workers in this machine's network.
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

from runner.core.lock import fresh_dir
from runner.core.netns import IsolationError, enter_private_network

RUN_PY = Path(__file__).resolve().parent.parent / "run.py"
# Set for every worker: the launch folder, which the worker's messages name.
LAUNCH_ENV = "TFMEMLAB_LAUNCH"
# A worker's exit after a signal, checkpointed (Interrupted: 128 + SIGINT/SIGTERM).
STOPPED = (130, 143)
# How long the others have to stop on their own once one worker has stopped on a signal.
STOP_GRACE_S = 60
# What --allow-network costs, in the launch's lines.
OPEN = "their TensorFlow servers listen on every interface, unauthenticated"


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


def resume_args(folder: Path, index: int, stamp: str) -> list[str]:
    """run.py's arguments for worker `index` of a launch that goes on: its run directory holds
    the job's config (run.json) and checkpoint; Hydra's own files go in a folder of their own."""
    run_dir = folder / f"worker{index}"
    return [
        sys.executable,
        str(RUN_PY),
        f"trainer.resume={run_dir}",
        f"hydra.run.dir={run_dir / 'resumed' / stamp}",
    ]


def launched_workers(folder: Path) -> int:
    """How many workers the launch in `folder` had (worker<i>/run.json)."""
    count = 0
    while (folder / f"worker{count}" / "run.json").is_file():
        count += 1
    return count


def _stop(workers: list[subprocess.Popen], sig: int) -> None:
    for w in workers:
        if w.poll() is None:
            w.send_signal(sig)


def _exit_code(code: int) -> int:
    """A worker's exit code as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def wait(workers: list[subprocess.Popen]) -> int:
    """Wait for every worker; the first to fail stops the others, and one stopped by a signal
    gives them STOP_GRACE_S to stop after the same step. The launch's exit code: a failed
    worker's, else a stopped one's (143, 130), else 0."""
    received: list[int] = []

    def pass_on(signum, frame) -> None:
        received.append(signum)
        _stop(workers, signal.SIGTERM if len(received) == 1 else signal.SIGKILL)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    stopped_at = None
    try:
        while any(w.poll() is None for w in workers):
            codes = [_exit_code(w.poll()) for w in workers if w.poll() is not None]
            if stopped_at is None and any(c in STOPPED for c in codes):
                stopped_at = time.monotonic()
            late = stopped_at is not None and time.monotonic() - stopped_at > STOP_GRACE_S
            if late or any(c not in (0, *STOPPED) for c in codes):
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
    codes = [_exit_code(w.wait()) for w in workers]
    failed = [c for c in codes if c not in (0, *STOPPED)]
    return (failed or [c for c in codes if c] or [0])[0]


def command_line() -> argparse.ArgumentParser:
    """The command line of `python -m runner.launch`."""
    parser = argparse.ArgumentParser(
        prog="python -m runner.launch",
        description="Start N local workers of one multi-worker job (distribution=multi_worker).",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (>= 2)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="launch folder (default outputs/launch/<time>)"
    )
    parser.add_argument(
        "--resume", type=Path, default=None, help="a launch folder whose workers were stopped"
    )
    parser.add_argument(
        "--allow-network",
        action="store_true",
        help="run the workers in this machine's network (default: a private network namespace, "
        f"loopback only); {OPEN}: for a tracking server, or where no namespace can be made",
    )
    parser.add_argument("overrides", nargs="*", help="run.py overrides, after --")
    return parser


def needs_network(uri: str) -> bool:
    """Whether the tracking store at `uri` is reached over the network (a server, a database
    server), which a private network namespace cannot; a SQLite file or a folder is not."""
    if uri.startswith(("sqlite:///", "file:")):
        return False
    return "://" in uri or uri.startswith("databricks")  # MLflow reads "databricks" as a server


def _tracking_uri(overrides: list[str]) -> str | None:
    """The store the job's chief logs to; None if the overrides do not compose (the command
    line's check then says why)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from runner.config import compose_config

    try:
        return compose_config(overrides).mlflow.tracking_uri
    except (HydraException, OmegaConfBaseException):
        return None


def _resumed_uri(folder: Path) -> str:
    """The store of the launch in `folder` (the chief's run.json), checked as the chief's
    `trainer.resume` will check it."""
    from runner.core.errors import ResumeError
    from runner.track.rundir import locate

    try:
        return locate(str(folder / "worker0"), []).tracking_uri
    except ResumeError as err:
        raise SystemExit(f"error: {err}") from None


def _refuse_a_network_store(uri: str | None, allow_network: bool) -> None:
    if uri is not None and needs_network(uri) and not allow_network:
        raise SystemExit(
            f"error: mlflow.tracking_uri={uri}: a launch's workers run in a private network "
            "(loopback only), where this store cannot be reached; log to a SQLite store "
            f"(sqlite:///<file>), or pass --allow-network to run them in this machine's network, "
            f"where {OPEN}"
        )


def _arguments(argv: list[str] | None) -> tuple[Path, list[list[str]], str]:
    """The launch folder, each worker's run.py command and where they will listen, from the
    launch's command line; bad input exits with one line, before any worker starts (and before
    TensorFlow loads). The private network is entered as soon as the store is known to allow
    it: before the command line's check, whose imports may start threads (numpy's OpenBLAS
    does), which unshare refuses."""
    parser = command_line()
    args = parser.parse_args(argv)
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    if args.resume is not None:
        count = launched_workers(args.resume)
        if count < 2 or args.overrides:
            parser.exit(
                2,
                f"error: --resume={args.resume}: expected the folder of a launch "
                "(worker<i>/run.json) and no overrides: the job is the one it ran\n",
            )
        _refuse_a_network_store(_resumed_uri(args.resume), args.allow_network)
        where = _network(args.allow_network)
        commands = [resume_args(args.resume, i, stamp) for i in range(count)]
        return args.resume, commands, where
    if args.workers < 2:
        parser.exit(2, f"error: --workers={args.workers}: expected an integer >= 2\n")
    from runner.cli import check_command_line

    overrides = ["distribution=multi_worker", *args.overrides]
    # Before the command line's check, which would try to reach a server.
    _refuse_a_network_store(_tracking_uri(overrides), args.allow_network)
    where = _network(args.allow_network)
    check_command_line(overrides)
    # a folder of its own, though named by the second (runner/core/lock.py)
    folder = args.dir or Path(fresh_dir(f"outputs/launch/{stamp.replace('_', '/')}"))
    commands = [worker_args(args.overrides, folder, i) for i in range(args.workers)]
    return folder, commands, where


def _network(allow_network: bool) -> str:
    """Where the workers will listen: this process enters a private network namespace, which
    they inherit, unless --allow-network says otherwise; a system without one is refused."""
    if allow_network:
        return f"in this machine's network (--allow-network): {OPEN}"
    try:
        enter_private_network()
    except IsolationError as err:
        raise SystemExit(
            f"error: no private network for the workers ({err}); --allow-network runs them "
            f"in this machine's network, where {OPEN}"
        ) from None
    return "in a private network namespace (loopback only: nothing outside the launch reaches them)"


def main(argv: list[str] | None = None) -> int:
    folder, commands, where = _arguments(argv)  # in the private network, unless allowed out
    folder.mkdir(parents=True, exist_ok=True)
    ports = free_ports(len(commands))
    workers = []
    for i, command in enumerate(commands):
        env = {**os.environ, "TF_CONFIG": tf_config(ports, i), LAUNCH_ENV: str(folder)}
        log = None if i == 0 else open(folder / f"worker{i}.log", "a")  # noqa: SIM115
        workers.append(
            subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT if log else None
            )
        )
    print(
        f"tfmemlab: launch: {len(commands)} workers, TF_CONFIG on 127.0.0.1 ports "
        f"{', '.join(map(str, ports))}, {where}; worker 0 (the chief) below, the others in "
        f"{folder}/worker<i>.log",
        flush=True,
    )
    code = wait(workers)
    if code in STOPPED:
        print(f"tfmemlab: launch: stopped; go on with: python -m runner.launch --resume {folder}")
    elif code:
        print(f"tfmemlab: launch: a worker failed (exit {code}); see {folder}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
