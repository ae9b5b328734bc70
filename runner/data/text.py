"""data=text: a text file read as bytes (vocabulary 256) for language modelling, streamed
(docs/data.md).

Windows of seq_len + 1 bytes side by side, read from the file as needed; the input is a
window's first seq_len bytes, the targets the seq_len bytes after the first. Validation: the
file's last data.val_fraction of windows, text the model has not trained on.
"""

import os
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from models.spec import DataSpec
from runner.core import datafiles
from runner.core.errors import ConfigError
from runner.data import checks
from runner.data.checks import require
from runner.data.contract import Request

if TYPE_CHECKING:  # the build side's: TensorFlow is imported when a build runs
    from runner.data.examples import Examples

KINDS = ("tokens",)
BYTE_VOCAB = 256  # a token is a byte


def check(d: DictConfig, request: Request) -> None:
    checks.val_fraction(d)
    require(not request.images, "data", "text", "model=transformer for data=text (bytes as tokens)")
    path = checks.files("data.path", d.path, "a text file")[0]
    size, need = os.path.getsize(path), 2 * (d.seq_len + 1)
    if size >= need:
        return
    longest = size // 2 - 1  # the longest seq_len that 2 windows of this file allow
    if longest >= 2:
        allowed = (
            f"at most {longest}: {path} holds {size} bytes, too short for 2 windows of "
            f"seq_len + 1 bytes ({need})"
        )
        raise ConfigError("data.seq_len", d.seq_len, allowed)
    said = "it is empty" if size == 0 else f"it holds {size} bytes"
    allowed = (
        f"a text file of at least 2 windows of seq_len + 1 bytes ({need} bytes at "
        f"data.seq_len={d.seq_len}); {said}"
    )
    raise ConfigError("data.path", d.path, allowed)


def _windows(path: str, size: int, first: int, count: int):
    """`count` windows of `size` bytes from window `first` on, read from the file as needed."""
    import tensorflow as tf

    total = os.path.getsize(path)
    return tf.data.FixedLengthRecordDataset(
        path, size, header_bytes=first * size, footer_bytes=total - (first + count) * size
    )


def build(d: DictConfig, request: Request) -> "Examples":
    """Windows of seq_len + 1 bytes (inputs, next-byte targets), streamed from the file; the
    file's last val_fraction of windows validate (text the model has not seen)."""
    import tensorflow as tf

    from runner.data.examples import Examples

    path, size = datafiles.match_files(d.path)[0], d.seq_len + 1
    windows = os.path.getsize(path) // size
    n_val = max(1, int(windows * d.val_fraction))
    train = _windows(path, size, 0, windows - n_val)
    val = _windows(path, size, windows - n_val, n_val)

    def prepare(window):
        tokens = tf.cast(tf.io.decode_raw(window, tf.uint8), tf.int32)
        return tokens[:-1], tokens[1:]

    spec = DataSpec("tokens", (d.seq_len,), BYTE_VOCAB, per_token=True, vocab_size=BYTE_VOCAB)
    return Examples(train, val, prepare, spec, windows - n_val)
