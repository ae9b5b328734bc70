"""The check of data=arrays, the one source whose check is not yet in runner/data/: an .npz's
arrays read from its headers (runner/core/datafiles.py), before TensorFlow is imported."""

import zipfile

from omegaconf import DictConfig

from runner.config.model import takes_images
from runner.core import datafiles
from runner.core.errors import ConfigError
from runner.data import checks
from runner.data.checks import require


def _arrays(d: DictConfig, image_model: bool, seq_len: int) -> None:
    path = checks.files("data.path", d.path, "an .npz file")[0]
    try:
        arrays = datafiles.npz_arrays(path)
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise ConfigError("data.path", d.path, f"an .npz file ({err})") from None
    have = ", ".join(sorted(arrays)) or "none"
    for key in ("x_key", "y_key"):
        require(d[key] in arrays, f"data.{key}", d[key], f"an array of {path}: {have}")
    x, y = arrays[d.x_key][0], arrays[d.y_key][0]
    if image_model:
        ok = len(x) == 3 or (len(x) == 4 and x[3] in (1, 3))
        require(ok, "data.x_key", d.x_key, f"images [N, H, W] or [N, H, W, 1|3]; it is {list(x)}")
        require(d.pixel_max > 0, "data.pixel_max", d.pixel_max, "a number > 0")
    else:
        require(len(x) == 2, "data.x_key", d.x_key, f"tokens [N, seq_len]; it is {list(x)}")
        allowed = f"{x[1]}, the length of the token arrays {d.x_key} in {path}"
        require(seq_len == x[1], "data.seq_len", seq_len, allowed)
    ok = y == (x[0],) or (not image_model and y == (x[0], x[1]))
    require(ok, "data.y_key", d.y_key, f"targets [{x[0]}] for {d.x_key} {list(x)}; it is {list(y)}")
    require(x[0] >= 2, "data.x_key", d.x_key, f"at least 2 examples; it has {x[0]}")


CHECKS = {"arrays": _arrays}


def check_data_source(cfg: DictConfig) -> None:
    """The check of data=arrays; nothing for the other sources."""
    checks.val_fraction(cfg.data)
    check = CHECKS.get(cfg.data.name)
    if check is not None:
        check(cfg.data, takes_images(cfg), cfg.data.seq_len)
