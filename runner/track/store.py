"""`python -m runner.track.store repair <mlflow.db>`: recover a damaged SQLite store's readable
runs into a new file, keeping the damaged one beside it (issue 48: runner/track/recover.py), or
finish a store whose creation was interrupted, without deleting a run (issue 16).

MLflow creates a SQLite store on first use and migrates it through its schema revisions.
SQLite's DDL is not transactional under Alembic's batch migrations, so processes that did so
at once on a fresh file (three `python run.py` started together, before tfmemlab locked the
store's creation) failed half-way, and left Alembic's temporary copy of a table
(`_alembic_tmp_<table>`) behind: every later run then failed with "table _alembic_tmp_...
already exists". Repair:
1. copies the database to `<db>.backup-<time>` first;
2. drops each `_alembic_tmp_<table>` whose table still exists (the copy is of that table, taken
   by a migration that did not finish); one whose table is gone holds the only copy of its
   rows, and is left alone with an error naming the backup;
3. lets MLflow create what is missing and finish the migrations, under tfmemlab's store lock.
"""

import argparse
import shutil
import sqlite3
import sys
import time
from pathlib import Path

from runner.core.errors import TrackingError
from runner.track.client import store_lock
from runner.track.recover import recover
from runner.track.store_faults import TMP_PREFIX, damage
from runner.track.store_faults import tables as store_tables


def damaged(db: Path) -> bool:
    """Whether SQLite finds the file damaged (its quick_check, or an error reading it)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            return damage(con) is not None
    except sqlite3.DatabaseError:
        return True


def repair(db: Path) -> tuple[Path, list[str]]:
    """(the backup written, the temporary tables dropped); raises TrackingError if a
    temporary table holds the only copy of its rows."""
    with store_lock(db):
        backup = db.with_name(f"{db.name}.backup-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.copy2(db, backup)
        dropped = []
        with sqlite3.connect(db) as con:
            tables = set(store_tables(con))
            for tmp in sorted(t for t in tables if t.startswith(TMP_PREFIX)):
                table = tmp[len(TMP_PREFIX) :]
                (rows,) = con.execute(f'SELECT COUNT(*) FROM "{tmp}"').fetchone()
                if table not in tables and rows:
                    raise TrackingError(
                        f"{db}: {tmp} holds the only copy of {rows} row(s) of {table}; nothing "
                        f"was changed beyond the backup {backup}: restore {table} from {tmp} by "
                        "hand, then run this again"
                    )
                con.execute(f'DROP TABLE "{tmp}"')
                dropped.append(tmp)
        from mlflow.tracking import MlflowClient

        try:  # creates what is missing, runs the remaining migrations, checks the schema
            MlflowClient(tracking_uri=f"sqlite:///{db.resolve()}")
        except Exception as err:
            raise TrackingError(
                f"{db}: its schema could not be finished ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200]}); the store as it was is in {backup}"
            ) from err
    return backup, dropped


def command_line() -> argparse.ArgumentParser:
    """The command line of `python -m runner.track.store`."""
    parser = argparse.ArgumentParser(prog="python -m runner.track.store", description=__doc__)
    parser.add_argument("action", choices=["repair"])
    parser.add_argument("db", type=Path, help="the SQLite file, e.g. outputs/mlflow.db")
    return parser


def _recovered(db: Path) -> str:
    """Recover a damaged store; what was recovered, in one line."""
    with store_lock(db):
        kept, counts, stand_ins = recover(db)
    lost = (
        f"; the experiment(s) of some runs were lost: they are under {', '.join(stand_ins)}"
        if stand_ins
        else ""
    )
    return (
        f"tfmemlab: {db} recovered into a new file: {counts.get('runs', 0)} run(s), "
        f"{counts.get('experiments', 0)} experiment(s), {counts.get('metrics', 0)} metric "
        f"value(s), {counts.get('tags', 0)} tag(s) were readable{lost}; the damaged file is "
        f"kept as {kept}"
    )


def main(argv: list[str]) -> None:
    args = command_line().parse_args(argv)
    if not args.db.is_file():
        raise SystemExit(f"error: {args.db}: no such file")
    if damaged(args.db):
        print(_recovered(args.db))
        return
    try:
        backup, dropped = repair(args.db)
    except TrackingError as err:
        raise SystemExit(f"error: {err}") from None
    print(
        f"tfmemlab: {args.db} repaired (backup: {backup}; dropped "
        f"{', '.join(dropped) or 'no temporary table'}); its runs are all kept"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
