"""Is the tracking store usable? Checked before TensorFlow (or MLflow) is imported."""

import sqlite3
from pathlib import Path

from runner.core.errors import TrackingError

SERVER_TIMEOUT_S = 5.0  # how long a tracking server has to answer tfmemlab's start-up check


def remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def check_reachable(uri: str, timeout: float = SERVER_TIMEOUT_S) -> None:
    """Raise TrackingError (one line) if the tracking server at `uri` does not answer within
    `timeout` seconds; local stores pass. Any HTTP answer counts: a server behind a proxy
    may not serve /health. MLflow's own client retries a refused connection for minutes with
    no output (issue 16: `http://127.0.0.1:9/` was still silent after 120 s)."""
    if not remote(uri):
        return
    import requests

    try:
        requests.get(f"{uri.rstrip('/')}/health", timeout=timeout)
    except requests.RequestException as err:
        if isinstance(err, requests.Timeout):
            reason = "no answer"
        elif isinstance(err, requests.ConnectionError):
            reason = "connection refused"
        else:
            reason = type(err).__name__
        raise TrackingError(
            f"mlflow.tracking_uri={uri}: no MLflow server answered within {timeout:g} s "
            f"({reason}); start one (mlflow server --host 127.0.0.1 --port <port>), or unset "
            "MLFLOW_TRACKING_URI to log to the embedded sqlite:///outputs/mlflow.db"
        ) from None


REPAIR = "python -m runner.track.store repair"
TMP_PREFIX = "_alembic_tmp_"  # Alembic's copy of a table during a batch migration


def sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def check_store(uri: str) -> None:
    """Raise TrackingError (one line) if the store at `uri` cannot be used: a server that does
    not answer, or a SQLite store whose creation was interrupted (runner/track/store.py)."""
    check_reachable(uri)
    db = sqlite_path(uri)
    if db is None or not db.is_file():
        return
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        names = [n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    broken = sorted(n for n in names if n.startswith(TMP_PREFIX))
    if broken:
        raise TrackingError(
            f"mlflow.tracking_uri={uri}: the store's creation was interrupted ({broken[0]} "
            f"was left behind); `{REPAIR} {db}` backs it up and finishes it (no run is deleted)"
        )
