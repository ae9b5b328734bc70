"""The checks of the data sources that read a user's files or code: tfrecord, arrays, text, custom.

Each bad value raises ConfigError (one line: the key, the bad value, what is allowed) before
TensorFlow is imported: files are matched, TFRecord features and .npz arrays read from the
files' first record and headers (runner/core/datafiles.py), a custom `_target_` found without
running it (runner/core/targets.py, as a model's is). What only the running function can say
(it raises, or returns no dataset of pairs) is checked when the data is built
(runner/train/custom.py).
"""

import os
import zipfile
from typing import Any

from omegaconf import DictConfig

from runner.config.model import takes_images
from runner.core import datafiles, targets
from runner.core.errors import ConfigError


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


def _files(key: str, pattern: str, what: str) -> list[str]:
    files = datafiles.match_files(pattern)
    _require(bool(files), key, pattern, f"{what} or a glob that matches one; it matches no file")
    return files


def _tfrecord(d: DictConfig, image_model: bool, seq_len: int) -> None:
    files = _files("data.path", d.path, "a TFRecord file")
    if d.val_path is not None:
        _files("data.val_path", d.val_path, "null, or a TFRecord file")
    try:
        features = datafiles.first_features(files[0])
    except (ValueError, IndexError, StopIteration) as err:
        raise ConfigError(
            "data.path", d.path, f"TFRecord files of tf.train.Example ({err})"
        ) from None
    have = ", ".join(f"{k} ({kind})" for k, (kind, _) in sorted(features.items())) or "none"
    need = (
        [("image_key", "bytes"), ("label_key", "int64")]
        if image_model
        else [("tokens_key", "int64")]
    )
    for key, kind in need:
        name = d[key]
        ok = name in features and features[name][0] == kind
        allowed = f"the name of a {kind} feature of {files[0]}'s records; they hold {have}"
        _require(ok, f"data.{key}", name, allowed)
    if image_model:
        allowed = "the number of label classes (>= 2) for a CNN"
        _require(d.num_classes >= 2, "data.num_classes", d.num_classes, allowed)
    else:
        _require(d.vocab_size >= 2, "data.vocab_size", d.vocab_size, "a number >= 2")
        count = features[d.tokens_key][1]
        allowed = (
            f"at most {count - 1}: a record holds seq_len + 1 tokens, {files[0]}'s first {count}"
        )
        _require(count >= seq_len + 1, "data.seq_len", seq_len, allowed)
    if d.train_records is not None:
        _require(d.train_records >= 2, "data.train_records", d.train_records, "null or >= 2")


def _arrays(d: DictConfig, image_model: bool, seq_len: int) -> None:
    path = _files("data.path", d.path, "an .npz file")[0]
    try:
        arrays = datafiles.npz_arrays(path)
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise ConfigError("data.path", d.path, f"an .npz file ({err})") from None
    have = ", ".join(sorted(arrays)) or "none"
    for key in ("x_key", "y_key"):
        _require(d[key] in arrays, f"data.{key}", d[key], f"an array of {path}: {have}")
    x, y = arrays[d.x_key][0], arrays[d.y_key][0]
    if image_model:
        ok = len(x) == 3 or (len(x) == 4 and x[3] in (1, 3))
        _require(ok, "data.x_key", d.x_key, f"images [N, H, W] or [N, H, W, 1|3]; it is {list(x)}")
        _require(d.pixel_max > 0, "data.pixel_max", d.pixel_max, "a number > 0")
    else:
        _require(len(x) == 2, "data.x_key", d.x_key, f"tokens [N, seq_len]; it is {list(x)}")
        allowed = f"{x[1]}, the length of the token arrays {d.x_key} in {path}"
        _require(seq_len == x[1], "data.seq_len", seq_len, allowed)
    ok = y == (x[0],) or (not image_model and y == (x[0], x[1]))
    _require(
        ok, "data.y_key", d.y_key, f"targets [{x[0]}] for {d.x_key} {list(x)}; it is {list(y)}"
    )
    _require(x[0] >= 2, "data.x_key", d.x_key, f"at least 2 examples; it has {x[0]}")


def _text(d: DictConfig, image_model: bool, seq_len: int) -> None:
    _require(not image_model, "data", "text", "model=transformer for data=text (bytes as tokens)")
    path = _files("data.path", d.path, "a text file")[0]
    windows = os.path.getsize(path) // (seq_len + 1)
    allowed = (
        f"at most {os.path.getsize(path) // 2 - 1}: {path} must hold 2 windows of seq_len + 1 bytes"
    )
    _require(windows >= 2, "data.seq_len", seq_len, allowed)


def _custom(d: DictConfig, image_model: bool, seq_len: int) -> None:
    reason = targets.problem(d._target_)
    allowed = f"an importable function pkg.module.fn: {reason}"
    _require(reason is None, "data._target_", d._target_, allowed)
    if d.train_records is not None:
        _require(d.train_records >= 2, "data.train_records", d.train_records, "null or >= 2")


CHECKS = {"tfrecord": _tfrecord, "arrays": _arrays, "text": _text, "custom": _custom}


def check_data_source(cfg: DictConfig) -> None:
    """The checks of data=tfrecord, arrays, text and custom; nothing for the other sources."""
    check = CHECKS.get(cfg.data.name)
    if check is not None:
        check(cfg.data, takes_images(cfg), cfg.data.seq_len)
