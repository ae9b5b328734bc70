"""The MLflow store: a client for a tracking URI, its experiment, and the UI's address.

The embedded default is a SQLite file (`sqlite:///outputs/mlflow.db`, no server); any other
URI (`MLFLOW_TRACKING_URI` or `mlflow.tracking_uri`) works the same. A SQLite store is
created under a lock beside it: MLflow's migrations, run by several processes at once on a
fresh file, failed all of them and left the store broken (issue 16).
"""

import argparse
import atexit
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from runner.config.schema import MlflowConfig
from runner.core.secrets import move_login_to_env, redact
from runner.track.server import remote, sqlite_path
from runner.track.store_faults import quiet_explained_faults, store_fault


def experiment_id(client: MlflowClient, name: str, uri: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    db = sqlite_path(uri)
    # Keep a local store's artifacts beside its database, not in ./mlruns of whatever cwd.
    location = (db.parent.resolve() / "mlartifacts").as_uri() if db else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        # A run started at the same moment created it first.
        return client.get_experiment_by_name(name).experiment_id


# MLflow 3's server starts huey worker processes for GenAI jobs unless this is false.
UI_ENV = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false"


def ui_hint(uri: str, experiment: str, run_id: str | None = None) -> tuple[str | None, str]:
    """(the command that serves the MLflow UI on this store or None, the page's URL).

    MLflow 3.17's UI opens an experiment on its GenAI overview; `workflowType=machine_learning`
    opens the runs table (read from the UI's own query string, MLflow 3.17; docs/usage.md).
    The command switches off the server's GenAI job runner (UI_ENV), which tfmemlab's runs do
    not use, and serves one user with one worker process (MLflow starts 4 of ~280 MiB each):
    `python -m runner.bench ui` measures what that saves (docs/usage.md).
    """
    page = f"#/experiments/{experiment}/runs" + (f"/{run_id}" if run_id else "")
    page += "?workflowType=machine_learning"
    uri = redact(uri)  # printed, and kept in the run's description: no login in it
    if uri.startswith(("http://", "https://")):
        return None, f"{uri.rstrip('/')}/{page}"
    command = f"{UI_ENV} mlflow ui --workers 1 --backend-store-uri {uri}"
    return command, f"http://127.0.0.1:5000/{page}"


@contextlib.contextmanager
def store_lock(db: Path):
    """Hold an exclusive lock on <db>.lock: MLflow creates and migrates a fresh SQLite store
    on first use, and three processes doing so at once all failed (`table _alembic_tmp_tags
    already exists`) and left the store broken for every later run (issue 16)."""
    import fcntl

    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def client_for(uri: str) -> MlflowClient:
    """A client of the store at `uri`; a SQLite store is created (or opened) under a lock, so
    runs started together on a fresh store all get it."""
    if remote(uri):
        # MLflow retries a failed request 7 times with backoff and waits 120 s for each: a
        # server lost mid-run would stall training for minutes at every call. These bounds
        # leave a slow server time to answer; the user's own settings win.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        # MLflow prints the URI it was given (`View run ... at: <uri>`): give it none with a
        # password in it; the login goes where its client reads one.
        return MlflowClient(tracking_uri=move_login_to_env(uri))
    db = sqlite_path(uri)
    if db is None:
        return MlflowClient(tracking_uri=uri)
    quiet_explained_faults()
    with store_lock(db):
        try:
            return MlflowClient(tracking_uri=uri)  # creates and migrates the store if need be
        except Exception as err:
            raise store_fault(db, err) from err


_SCRATCH: list[Path] = []  # an empty, migrated SQLite store, made once per process


def scratch_store(folder: str | Path, name: str = "mlflow.db") -> str:
    """The URI of a new, empty SQLite store at folder/name, for runs thrown away with folder
    (a benchmark's jobs, a plan's probes): a copy of one that MLflow created and migrated once
    in this process. Creating each afresh cost the process that opened it its schema
    migrations (3.7 s measured in each probe of runner.plan)."""
    if not _SCRATCH:
        home = Path(tempfile.mkdtemp(prefix="tfmemlab-scratch-store-"))
        atexit.register(shutil.rmtree, home, True)
        MlflowClient(tracking_uri=f"sqlite:///{home}/empty.db").search_experiments()
        _SCRATCH.append(home / "empty.db")
    shutil.copy(_SCRATCH[0], Path(folder) / name)
    return f"sqlite:///{Path(folder) / name}"


def add_tracking_uri(parser: argparse.ArgumentParser) -> None:
    """The --tracking-uri option of tfmemlab's command-line tools: MLFLOW_TRACKING_URI, else
    the embedded default store, as in conf/."""
    parser.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI", MlflowConfig.tracking_uri),
    )
