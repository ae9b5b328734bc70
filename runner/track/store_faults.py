"""What is wrong with a SQLite store, told in one line with what to do (issues 16, 48): a full
disk under it (free space there, or another store), a damaged file (recover what is readable,
`python -m runner.track.store repair`), or a creation that was interrupted (finish it, the same
command). Neither MLflow nor TensorFlow is imported: the command line checks the store first.

SQLite names the fault by its result code (sqlite3's `sqlite_errorname`, Python 3.11):
SQLITE_FULL for a full disk ("database or disk is full"), SQLITE_CORRUPT ("database disk image
is malformed") and SQLITE_NOTADB ("file is not a database") for a damaged file. MLflow's store
raises its exception from SQLAlchemy's, raised from the sqlite3 error (runner/core/diskfull.py
chain walks them).
"""

import logging
import shutil
import sqlite3
from pathlib import Path

from runner.core.diskfull import chain, disk_full, free_bytes
from runner.core.errors import TrackingError

REPAIR = "python -m runner.track.store repair"
TMP_PREFIX = "_alembic_tmp_"  # Alembic's copy of a table during a batch migration
DAMAGED = ("SQLITE_CORRUPT", "SQLITE_NOTADB")


def sqlite_errors(err: BaseException):
    """The sqlite3 errors and OSErrors in `err`'s chain (MLflow's exception is raised from
    SQLAlchemy's, which is raised from sqlite3's)."""
    return (link for link in chain(err) if isinstance(link, sqlite3.Error | OSError))


def kind(err: BaseException) -> str | None:
    """ "full", "damaged" or None (any other fault) for an error of a SQLite store."""
    if disk_full(err) is not None:  # SQLITE_FULL or ENOSPC, as any write of the run
        return "full"
    damaged = (getattr(link, "sqlite_errorname", "") in DAMAGED for link in sqlite_errors(err))
    return "damaged" if any(damaged) else None


def tables(con: sqlite3.Connection) -> list[str]:
    """The names of a SQLite database's tables."""
    return [n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]


def damage(con: sqlite3.Connection) -> str | None:
    """quick_check's first finding in a SQLite file, or None when it finds none; an error
    reading the file is raised. quick_check reads every page: a few milliseconds for a store of
    a few MiB."""
    verdict = con.execute("PRAGMA quick_check(1)").fetchone()[0]
    return None if verdict == "ok" else f"SQLite's quick_check: {verdict.splitlines()[0][:160]}"


class _Explained(logging.Filter):
    """Drops MLflow's own report of a fault tfmemlab explains in one line: its store logs every
    SQLAlchemy OperationalError with a traceback (mlflow/store/db/utils.py) before it raises."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return err is None or kind(err) is None


_EXPLAINED = _Explained()


def quiet_explained_faults() -> None:
    """MLflow's SQLite store then says nothing of a full disk or a damaged file: the error it
    raises reaches the user as one line."""
    logging.getLogger("mlflow.store.db.utils").addFilter(_EXPLAINED)


def _first_line(err: BaseException) -> str:
    for link in sqlite_errors(err):
        return str(link).splitlines()[0][:160]
    return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


def store_fault(db: Path, err: BaseException, shown: str | None = None) -> TrackingError:
    """The one line for the store at `db` that failed with `err`. `shown`: the URI as the user
    gave it (redacted), else sqlite:///db."""
    shown = shown or f"sqlite:///{db}"
    what = kind(err)
    if what == "full":
        free = free_bytes(db)
        left = "" if free is None else f"; {free / 2**20:.1f} MiB left"
        return TrackingError(
            f"mlflow.tracking_uri={shown}: the disk under the store is full ({_first_line(err)}"
            f"{left} on the filesystem of {db.parent.absolute()}): free space there, or point "
            "mlflow.tracking_uri at a store on another disk; no run was recorded"
        )
    if what == "damaged":
        return damaged(db, _first_line(err), shown)
    return TrackingError(
        f"mlflow.tracking_uri={shown}: the store cannot be opened ({_first_line(err)}); "
        f"`{REPAIR} {db}` backs it up and finishes its schema (no run is deleted)"
    )


def damaged(db: Path, reason: str, shown: str) -> TrackingError:
    """The one line for a damaged store file, with the way to recover its runs."""
    how = (
        f"`{REPAIR} {db}` recovers what is readable into a new file and keeps the damaged one "
        "beside it"
        if shutil.which("sqlite3")
        else "recovering it needs SQLite's command line, sqlite3 (e.g. apt-get install "
        f"sqlite3), then `{REPAIR} {db}`"
    )
    return TrackingError(
        f"mlflow.tracking_uri={shown}: the store's file is damaged ({reason}); {how}; or point "
        "mlflow.tracking_uri at a new store"
    )


def check_file(db: Path, shown: str) -> None:
    """Raise TrackingError (one line) if the SQLite store at `db` is damaged, or its creation
    was interrupted (Alembic's temporary table left behind)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            names, reason = tables(con), damage(con)
    except sqlite3.Error as err:
        raise store_fault(db, err, shown) from None
    if reason is not None:
        raise damaged(db, reason, shown)
    broken = sorted(n for n in names if n.startswith(TMP_PREFIX))
    if broken:
        raise TrackingError(
            f"mlflow.tracking_uri={shown}: the store's creation was interrupted ({broken[0]} "
            f"was left behind); `{REPAIR} {db}` backs it up and finishes it (no run is deleted)"
        )
