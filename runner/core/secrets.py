"""Credentials kept out of everything tfmemlab writes or prints (issue 27).

A tracking URI may carry a login (`http://user:token@host:5000`), and MLflow's client reads a
password or token from the environment (MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN).
tfmemlab logs the whole resolved config, the command line and error messages: each place
that writes or prints one of them passes it through `redact` (text) or `redact_obj` (a
config as nested dicts), and `scrub_files` rewrites Hydra's own files of a run or sweep.
A URI loses its userinfo (it stays a working address: the login then comes from the
environment); a secret variable's value, wherever it appears, becomes `***`.
"""

import logging
import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

# Variables whose values MLflow's client sends as credentials (mlflow/utils/credentials.py).
SECRET_ENV = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
USER_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"
MASK = "***"
# A shorter value would mask innocent text wherever it occurs (a password `train` would turn
# every `data.train_samples` in run.json into `data.***_samples`); real tokens are longer.
_MIN_SECRET = 8
# scheme://userinfo@: the userinfo runs to the authority's last '@' (no '/', '?', '#', space).
# Hydra writes a sweep's overrides with ':' escaped (`http\://user\:pw@host\:5000`).
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*\\?://)[^/?#\s'\"@]*(?:@[^/?#\s'\"@]*)*@")


def strip_userinfo(uri: str) -> str:
    """`uri` without the `user:password@` of its authority; other text unchanged."""
    return _USERINFO.sub(r"\1", uri)


def credentials(uri: str) -> tuple[str, str] | None:
    """(user, password) from the userinfo of `uri`, percent-decoded, or None."""
    parts = urlsplit(uri)
    if parts.username is None:
        return None
    return unquote(parts.username), unquote(parts.password or "")


def move_login_to_env(uri: str) -> str:
    """The URI without its userinfo, its login put where MLflow's client reads one
    (MLFLOW_TRACKING_USERNAME/PASSWORD), so that no MLflow object holds, and no MLflow
    message prints, the URI with its password (MLflow prints `View run ... at: <uri>`)."""
    login = credentials(uri)
    if login is None:
        return uri
    os.environ[USER_ENV], os.environ[PASSWORD_ENV] = login
    parts = urlsplit(uri)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _secret_values() -> list[str]:
    values = [os.environ.get(name, "") for name in SECRET_ENV]
    return sorted({v for v in values if len(v) >= _MIN_SECRET}, key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with the userinfo of every URL in it removed and the value of every secret
    variable (SECRET_ENV) masked."""
    text = strip_userinfo(text)
    for value in _secret_values():
        text = text.replace(value, MASK)
    return text


def redact_obj(obj):
    """A copy of nested dicts, lists and tuples with every string in them redacted."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {redact_obj(k): redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(redact_obj(v) for v in obj)
    return obj


# Hydra writes the command line and the composed config into these, before tfmemlab's code
# runs: a URI given as an override (mlflow.tracking_uri=http://user:pw@host) is in them.
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml", "multirun.yaml")


def scrub_files(folder: Path, names: tuple[str, ...] = HYDRA_FILES) -> None:
    """Redact, in place, the files under `folder` (any depth) with one of these names."""
    for name in names:
        for path in Path(folder).glob(f"**/{name}"):
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError):
                continue
            clean = redact(text)
            if clean != text:
                path.write_text(clean)


def redact_logs() -> None:
    """Redact every log record from now on, as it is made: Hydra logs a sweep's overrides
    (`#0 : mlflow.tracking_uri=http://user:pw@host ...`) and sets up its log handlers again
    at each launch, so a filter on today's handlers would not last."""
    make = logging.getLogRecordFactory()
    if getattr(make, "redacts", False):
        return

    def redacted(*args, **kwargs) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            record.msg, record.args = redact(record.getMessage()), None
        except (TypeError, ValueError):  # a malformed call: logging reports it as it would
            pass
        return record

    redacted.redacts = True
    logging.setLogRecordFactory(redacted)
