"""One process at a time in a run directory or a sweep folder (issue 27).

Two `trainer.resume` of one run directory started together both ran to the end in the same
MLflow run (the steps after the checkpoint were logged twice) and both wrote checkpoints into
the same folder. Now a folder is held by one process: `<folder>/.lock` is locked with
`flock`, which the kernel releases when the holder dies however it dies (SIGKILL included), and
holds a JSON record {pid, host, started, heartbeat} that names the holder in the one line the
next comer gets (BusyError). The record also covers what `flock` does not: on a file system
where `flock` does nothing, a holder on this host counts while its pid lives; a holder on
another host (a shared file system) counts while its heartbeat, refreshed every HEARTBEAT_S
seconds by a daemon thread, is younger than STALE_S. TensorFlow-free: the command line asks
before anything loads.
"""

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from runner.core.errors import BusyError
from runner.core.process import pid_alive

LOCK_FILE = ".lock"
HEARTBEAT_S = 5.0
STALE_S = 6 * HEARTBEAT_S  # a few missed beats: a holder on another host that died
# The record is rewritten in place, padded to one size: a reader never finds it empty or cut
# short, and the file keeps its inode (a rename would leave the flock on the old one).
RECORD_BYTES = 512
UNKNOWN = {"pid": "?", "host": "?", "started": "?"}


def read_record(folder: Path) -> dict | None:
    """The record in `folder`'s lock file; None when there is none (never held, or released)."""
    try:
        record = json.loads((Path(folder) / LOCK_FILE).read_text() or "null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "pid" in record else None


def is_live(record: dict, now: float | None = None) -> bool:
    """Whether the holder a record names still holds: on another host, while its heartbeat is
    recent; on this host, while its process lives too (a pid the system gave to a new
    process after the holder died beats no heartbeat)."""
    now = time.time() if now is None else now
    fresh = now - float(record.get("heartbeat", 0)) < STALE_S
    if record.get("host") == socket.gethostname():
        return fresh and pid_alive(int(record["pid"]))
    return fresh


def holder(folder: Path) -> dict | None:
    """The live holder of `folder`, read without taking the lock (so that asking changes
    nothing); None when the folder is free."""
    record = read_record(folder)
    return record if record is not None and is_live(record) else None


def busy(what: str, record: dict) -> BusyError:
    return BusyError(
        f"{what}: held by process {record['pid']} on host {record['host']} (started "
        f"{record['started']}); wait for it to end, or stop it"
    )


def check_free(folder: Path, what: str) -> None:
    """Raise BusyError (one line, `what` first) when a live process holds `folder`."""
    record = holder(folder)
    if record is not None:
        raise busy(what, record)


class FolderLock:
    """`with FolderLock(folder, what):` holds `folder` for the block, or raises BusyError
    naming the holder. `what` opens the message: the key the user gave, e.g.
    `trainer.resume=<dir>`."""

    def __init__(self, folder: Path, what: str):
        self.folder, self.what = Path(folder), what
        self._fd: int | None = None
        self._record: dict = {}
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> "FolderLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise busy(self.what, self._written_record()) from None
        record = read_record(self.folder)
        if record is not None and is_live(record):  # flock did nothing, or another host
            os.close(fd)
            raise busy(self.what, record)
        self._fd = fd
        now = time.time()
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        self._record = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
        self._write(now)
        self._beat = threading.Thread(target=self._heartbeat, name="folder-lock", daemon=True)
        self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=2 * HEARTBEAT_S)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                if self._ours():  # the empty file is a free folder
                    os.ftruncate(self._fd, 0)
            os.close(self._fd)  # releases the flock
            self._fd = None

    def _written_record(self) -> dict:
        """The holder's record; a holder that has just taken the flock writes it at once."""
        for _ in range(10):
            record = read_record(self.folder)
            if record is not None:
                return record
            time.sleep(0.05)
        return UNKNOWN

    def _write(self, now: float) -> None:
        data = json.dumps({**self._record, "heartbeat": now}).ljust(RECORD_BYTES)
        os.pwrite(self._fd, data.encode(), 0)
        os.fsync(self._fd)  # another host reads the file through its own cache

    def _ours(self) -> bool:
        record = read_record(self.folder) or {}
        return (record.get("pid"), record.get("host")) == (os.getpid(), socket.gethostname())

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self._ours():  # taken over while this process was stopped past STALE_S
                print(f"tfmemlab: warning: {self.what}: taken over", file=sys.stderr)
                return
            with contextlib.suppress(OSError):
                self._write(time.time())


_CLAIMED: dict[str, str] = {}


def fresh_dir(base: str) -> str:
    """A folder named `base` (or `base-2`, `base-3`, ... when another process took it), made
    by this call so that no one else has it: Hydra names a folder by the second, and runs or
    sweeps started in the same second from one place would otherwise share one. The
    `tfmemlab_fresh_dir` resolver in conf/config.yaml; one answer per `base` in a process
    (Hydra resolves the name more than once, and copies the answer to its jobs)."""
    if base in _CLAIMED:
        return _CLAIMED[base]
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        _CLAIMED[base] = path
        return path
    raise OSError(f"{base}: 10,000 folders of that name are taken")
