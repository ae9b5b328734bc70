"""Is the tracking store usable? Checked before TensorFlow (or MLflow) is imported."""

import os
from pathlib import Path
from urllib.parse import urlsplit

from runner.core.errors import TrackingError
from runner.core.secrets import PASSWORD_ENV, USER_ENV, credentials, redact, strip_userinfo
from runner.track.store_faults import check_file

SERVER_TIMEOUT_S = 5.0  # how long a tracking server has to answer tfmemlab's start-up check


def remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def check_reachable(uri: str, timeout: float = SERVER_TIMEOUT_S) -> None:
    """Raise TrackingError (one line) if the tracking server at `uri` does not answer within
    `timeout` seconds, or asks for a login it was not given; local stores pass. Any other
    HTTP answer counts: a server behind a proxy may not serve MLflow's API as such. MLflow's
    own client retries a refused connection for minutes with no output (issue 16:
    `http://127.0.0.1:9/` was still silent after 120 s), and a missing login only shows up
    as an MlflowException once the job is under way (issue 27)."""
    if not remote(uri):
        return
    import requests

    shown = redact(uri)
    try:
        # An endpoint that needs a login on a server run with `--app-name basic-auth` (its
        # /health answers anyone), asked with the login MLflow's client would send.
        answer = requests.get(
            f"{strip_userinfo(uri).rstrip('/')}{PROBE}", timeout=timeout, **_login(uri)
        )
    except requests.RequestException as err:
        if isinstance(err, requests.Timeout):
            reason = "no answer"
        elif isinstance(err, requests.ConnectionError):
            reason = "connection refused"
        else:
            reason = type(err).__name__
        raise TrackingError(
            f"mlflow.tracking_uri={shown}: no MLflow server answered within {timeout:g} s "
            f"({reason}); start one (mlflow server --host 127.0.0.1 --port <port>), or unset "
            "MLFLOW_TRACKING_URI to log to the embedded sqlite:///outputs/mlflow.db"
        ) from None
    if answer.status_code == 401:
        raise TrackingError(
            f"mlflow.tracking_uri={shown}: the server requires login (HTTP 401); set "
            f"{USER_ENV} and {PASSWORD_ENV}"
            + (" (the login given was refused)" if _login(uri) else "")
        )
    if answer.status_code == 403 and answer.text.startswith("Invalid Host header"):
        # MLflow's security middleware: the name the client used is not in --allowed-hosts
        # (by default localhost and private addresses only; a host name is refused).
        raise TrackingError(
            f"mlflow.tracking_uri={shown}: the server refuses requests addressed to "
            f"'{urlsplit(uri).hostname}' (HTTP 403: Invalid Host header); start it with "
            f"--allowed-hosts naming {urlsplit(uri).netloc.rpartition('@')[2]}"
        )
    if answer.status_code == 403:
        raise TrackingError(
            f"mlflow.tracking_uri={shown}: the user has no permission on this server (HTTP "
            f"403); ask its admin for access, or set {USER_ENV} and {PASSWORD_ENV} to another "
            "user"
        )


PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"


def _login(uri: str) -> dict:
    """requests' keyword arguments for the login MLflow's client sends to `uri`: the URI's
    userinfo, else MLFLOW_TRACKING_USERNAME/PASSWORD, else MLFLOW_TRACKING_TOKEN (bearer)."""
    login = credentials(uri)
    if login is None and os.environ.get(USER_ENV) and os.environ.get(PASSWORD_ENV):
        login = (os.environ[USER_ENV], os.environ[PASSWORD_ENV])
    if login is not None:
        return {"auth": login}
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    return {"headers": {"Authorization": f"Bearer {token}"}} if token else {}


def sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def check_store(uri: str) -> None:
    """Raise TrackingError (one line) if the store at `uri` cannot be used: a server that does
    not answer, or a SQLite store that is damaged or whose creation was interrupted
    (runner/track/store_faults.py)."""
    check_reachable(uri)
    db = sqlite_path(uri)
    if db is None or not db.is_file():
        return
    check_file(db, redact(uri))
