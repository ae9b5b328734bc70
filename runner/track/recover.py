"""Recover the readable runs of a damaged SQLite store into a new one (issue 48): a file cut
short by a full disk or a copy that stopped reads "database disk image is malformed".

SQLite's own tool for this, the command line's `.recover`, needs the `sqlite_dbpage` virtual
table (SQLITE_ENABLE_DBPAGE_VTAB), which common builds leave out: Debian 12's sqlite3 3.40.1
fails with "SQL logic error" on an intact file. So the rows are read through SQL, table by
table, as far as each table's pages can be read: in a file cut in half, a table whose pages lie
before the cut reads whole, and one whose root lies past it reads nothing. They go into a store
MLflow creates afresh (its current schema), so the result opens as any store does. Runs whose
experiment was lost are kept under a stand-in experiment, `recovered-<id>`.
"""

import os
import sqlite3
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from runner.track.store_faults import tables

SKIP = {"alembic_version", "sqlite_sequence"}  # the fresh store's own


def _columns(con: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in con.execute(f'PRAGMA table_info("{table}")')]


def readable_rows(src: sqlite3.Connection, table: str, columns: list[str]) -> list[tuple]:
    """The rows of `table` SQLite can read, in rowid order: after a damaged page, reading goes
    on from rowids further on (1, 2, 4, ... past the last read), until none answers."""
    names = ", ".join(f'"{c}"' for c in columns)
    rows, last = [], 0
    while True:
        try:
            for row in src.execute(
                f'SELECT rowid, {names} FROM "{table}" WHERE rowid > ? ORDER BY rowid', (last,)
            ):
                rows.append(row[1:])
                last = row[0]
            return rows
        except sqlite3.DatabaseError:
            pass
        for jump in (2**k for k in range(24)):
            try:
                found = src.execute(
                    f'SELECT rowid FROM "{table}" WHERE rowid > ? ORDER BY rowid LIMIT 1',
                    (last + jump,),
                ).fetchone()
            except sqlite3.DatabaseError:
                continue
            if found is None:
                return rows
            last = found[0] - 1
            break
        else:
            return rows


def _stand_in_experiments(dst: sqlite3.Connection) -> list[str]:
    """Experiments the recovered runs belong to but whose rows were lost: each gets a row named
    recovered-<id>, its artifact location the folder its runs' artifacts are in."""
    known = {str(e) for (e,) in dst.execute("SELECT experiment_id FROM experiments")}
    lost = dst.execute("SELECT experiment_id, MIN(artifact_uri) FROM runs GROUP BY experiment_id")
    added = []
    for experiment, artifact_uri in lost.fetchall():
        if str(experiment) in known:
            continue
        location = str(Path(artifact_uri or ".").parent.parent) if artifact_uri else ""
        dst.execute(
            "INSERT INTO experiments (experiment_id, name, artifact_location, lifecycle_stage,"
            " creation_time, last_update_time) VALUES (?, ?, ?, 'active', ?, ?)",
            (experiment, f"recovered-{experiment}", location, *[int(time.time() * 1000)] * 2),
        )
        added.append(f"recovered-{experiment}")
    return added


def recover(db: Path) -> tuple[Path, dict[str, int], list[str]]:
    """Recovers `db` in place: (where the damaged file is kept, rows recovered per table, the
    stand-in experiments). The caller holds the store's lock."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = db.with_name(f"{db.name}.damaged-{stamp}")
    new = db.with_name(f"{db.name}.recovering-{stamp}")
    try:
        counts, stand_ins = _copy_readable(db, new)
    except BaseException:
        new.unlink(missing_ok=True)  # the damaged file is left as it was
        raise
    for suffix in ("", "-journal", "-wal", "-shm"):  # a stale journal must not meet the new file
        old = db.with_name(db.name + suffix)
        if old.exists():
            os.replace(old, kept.with_name(kept.name + suffix))
    os.replace(new, db)
    return kept, counts, stand_ins


def _copy_readable(db: Path, new: Path) -> tuple[dict[str, int], list[str]]:
    """A fresh store at `new` holding what can be read of `db`: (rows per table, stand-ins)."""
    MlflowClient(tracking_uri=f"sqlite:///{new.resolve()}").search_experiments()  # a fresh store
    src = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    # A schema SQLite cannot read whole is read as far as it can be, not refused: each table's
    # own entry is what its rows need (the pragma changes nothing in a read-only file).
    src.execute("PRAGMA writable_schema=ON")
    counts: dict[str, int] = {}
    with sqlite3.connect(new) as dst:
        for table in tables(dst):
            if table in SKIP:
                continue
            try:
                have = set(_columns(src, table))
            except sqlite3.DatabaseError:
                have = set()
            columns = [c for c in _columns(dst, table) if c in have]
            if not columns:  # the table's definition itself is unreadable
                counts[table] = 0
                continue
            rows = readable_rows(src, table, columns)
            names = ", ".join(f'"{c}"' for c in columns)
            marks = ", ".join("?" * len(columns))
            dst.executemany(f'INSERT OR REPLACE INTO "{table}" ({names}) VALUES ({marks})', rows)
            counts[table] = len(rows)
        stand_ins = _stand_in_experiments(dst)
        # Rows whose parent was lost (a metric of a run that was not readable) would break
        # MLflow's foreign keys, which its store switches on: they go.
        for table, rowid, _, _ in dst.execute("PRAGMA foreign_key_check").fetchall():
            dst.execute(f'DELETE FROM "{table}" WHERE rowid = ?', (rowid,))
    src.close()
    MlflowClient(tracking_uri=f"sqlite:///{new.resolve()}").search_experiments()  # it opens
    return counts, stand_ins
