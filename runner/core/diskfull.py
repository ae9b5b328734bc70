"""A full disk, told apart from everything else (issue 27): an OSError with errno ENOSPC or
EDQUOT anywhere in an error's chain (MLflow wraps the OSError of its artifact copy), SQLite's
SQLITE_FULL (a store's write: issue 48), or a
TensorFlow error whose message says so (SaveV2 raises ResourceExhaustedError for ENOSPC, which
is not running out of memory). TensorFlow-free: training and tracking both use it.
"""

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

from runner.core.errors import DiskFull

_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_MESSAGES = tuple(os.strerror(n) for n in _ERRNOS)  # as TensorFlow words them, from errno
# TensorFlow's file errors read "<path>; No space left on device".
_TF_PATH = re.compile(r"(/[^;\s]+); (?:" + "|".join(map(re.escape, _MESSAGES)) + ")")


def free_bytes(path) -> int | None:
    """Bytes free on the filesystem of `path` (or of its nearest folder that exists)."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def chain(err: BaseException | None):
    """`err` and the errors it was raised from (its causes, else its contexts), once each."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def disk_full(err: BaseException, path=None, then: str = "") -> DiskFull | None:
    """The DiskFull `err` is (an error of its chain that says the disk is full), naming the
    file in the error, else `path`; None for any other error."""
    for link in chain(err):
        if isinstance(link, DiskFull):
            return link
        if getattr(link, "sqlite_errorname", "") == "SQLITE_FULL":  # an MLflow store's write
            where = path or "the SQLite store"
            return DiskFull(where, str(link), free_bytes(where) if path else None, then)
        if isinstance(link, OSError) and link.errno in _ERRNOS:
            where = link.filename or path or "a file"
            return DiskFull(where, os.strerror(link.errno), free_bytes(where), then)
        message = str(getattr(link, "message", "") or link)
        said = [m for m in _MESSAGES if m in message]
        if said and type(link).__module__.startswith("tensorflow"):
            found = _TF_PATH.search(message)
            where = found.group(1) if found else path or "a file"
            return DiskFull(where, said[0], free_bytes(where), then)
    return None


@contextlib.contextmanager
def writing(path):
    """Around a write of `path`: a full disk there becomes DiskFull naming it (the OSError of a
    failed write() names no file)."""
    try:
        yield
    except Exception as err:
        full = disk_full(err, path)
        if full is None:
            raise
        raise full from err
