"""Running something in a fresh Python process, and asking whether a process is alive.

TensorFlow keeps memory for the life of a process, and jobs run one after another in one
process were measured charged for earlier ones (a small job's peak rose from 36.0 to 52.3 MB
after a larger job). So whatever must measure one job alone (a probe of accum=auto, a
benchmark's job, a sweep's job) runs in a process of its own.
"""

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager


def _start() -> None:
    """The child's first act: TensorFlow imported quietly. It runs before the task arrives,
    whose unpickling imports the function's module, and with it TensorFlow, loudly."""
    from runner.core.start import import_tensorflow

    import_tensorflow()


def in_fresh_process(
    function: Callable, *args, unset: tuple[str, ...] = (), tensorflow: bool = True
):
    """function(*args) in a fresh Python process (spawned, so that nothing of this one's
    TensorFlow is inherited), waited for; its return value (picklable) comes back.
    `unset`: environment variables the child runs without (e.g. the CPU allocator's limit).
    tensorflow=False: the child does not import TensorFlow first, for a function whose module
    does not import it (a LiteRT model measured as it is served, runner/deploy/child.py).
    The child is no daemon, so it may start fresh processes of its own (a benchmark's or a
    sweep's job measuring its deployment variants), which multiprocessing.Pool's daemonic
    workers may not; a child that dies raises BrokenProcessPool here instead of hanging. One
    task and no max_tasks_per_child: with it, the executor starts a replacement worker (which
    imports TensorFlow) when the first exits, and waits for it at shutdown (11.2 s a fresh
    process here, against 4.2 s without it)."""
    with _environment({name: None for name in unset}):
        spawn = multiprocessing.get_context("spawn")
        start = _start if tensorflow else None
        with ProcessPoolExecutor(1, spawn, initializer=start) as pool:
            return pool.submit(function, *args).result()


def in_fresh_processes(
    function: Callable, tasks: list[tuple], processes: int, env: dict[str, str] | None = None
) -> list:
    """[function(*args) for args in tasks], computed in `processes` fresh Python processes at
    once (spawned, TensorFlow imported first, as in_fresh_process), each taking the next task
    as it finishes one; the results in the tasks' order. `env`: variables the children start
    with beside this process's environment (this one's is as it was when they return)."""
    with _environment(env or {}):
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(processes, spawn, initializer=_start) as pool:
            futures = [pool.submit(function, *args) for args in tasks]
            return [f.result() for f in futures]


@contextmanager
def _environment(changes: dict[str, str | None]):
    """This process's environment with `changes` (None: the variable unset) while the block
    runs, for the children it starts; as it was afterwards."""
    saved = {name: os.environ.get(name) for name in changes}
    try:
        for name, value in changes.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
