"""The checks data sources share, TensorFlow-free: one line (ConfigError) for a bad value."""

from typing import Any

from omegaconf import DictConfig

from runner.core import datafiles
from runner.core.errors import ConfigError


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


def files(key: str, pattern: str, what: str) -> list[str]:
    """The files `pattern` matches; ConfigError naming `key` when it matches none."""
    found = datafiles.match_files(pattern)
    require(bool(found), key, pattern, f"{what} or a glob that matches one; it matches no file")
    return found


def val_fraction(d: DictConfig) -> None:
    """The share of examples held out for validation."""
    ok = 0.0 < d.val_fraction < 1.0
    require(ok, "data.val_fraction", d.val_fraction, "a number in (0, 1)")


def train_records(d: DictConfig) -> None:
    """data.train_records, the size of the training split when given."""
    if d.train_records is not None:
        require(d.train_records >= 2, "data.train_records", d.train_records, "null or >= 2")
