"""data=arrays: arrays x and y of an .npz file, loaded into memory (docs/data.md).

The check reads the arrays' shapes from the file's headers (runner/core/datafiles.py), which
also give data.seq_len and data.image_size when the config leaves them null (from_files); the
build holds one copy of the arrays in host variables that the map reads by index, so the
shuffle buffer holds indices, not images. Validation: a seeded share of the examples.
"""

import zipfile
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

KINDS = ("image", "tokens")


def check(d: DictConfig, request: Request) -> None:
    checks.val_fraction(d)
    path = checks.files("data.path", d.path, "an .npz file")[0]
    try:
        arrays = datafiles.npz_arrays(path)
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise ConfigError("data.path", d.path, f"an .npz file ({err})") from None
    have = ", ".join(sorted(arrays)) or "none"
    for key in ("x_key", "y_key"):
        require(d[key] in arrays, f"data.{key}", d[key], f"an array of {path}: {have}")
    x, y = arrays[d.x_key][0], arrays[d.y_key][0]
    if request.images:
        ok = len(x) == 3 or (len(x) == 4 and x[3] in (1, 3))
        require(ok, "data.x_key", d.x_key, f"images [N, H, W] or [N, H, W, 1|3]; it is {list(x)}")
        require(d.pixel_max > 0, "data.pixel_max", d.pixel_max, "a number > 0")
    else:
        ok = len(x) == 2 and x[1] >= 2
        require(ok, "data.x_key", d.x_key, f"tokens [N, seq_len >= 2]; it is {list(x)}")
        # The length is the file's: only a value set against it is refused (issue 48).
        allowed = (
            f"{x[1]}, the length of the token arrays {d.x_key} in {path}, or no value "
            "(then it is taken from there)"
        )
        require(d.seq_len in (None, x[1]), "data.seq_len", d.seq_len, allowed)
    ok = y == (x[0],) or (not request.images and y == (x[0], x[1]))
    require(ok, "data.y_key", d.y_key, f"targets [{x[0]}] for {d.x_key} {list(x)}; it is {list(y)}")
    require(x[0] >= 2, "data.x_key", d.x_key, f"at least 2 examples; it has {x[0]}")


def from_files(d: DictConfig, request: Request) -> dict[str, int]:
    """What the file says of the keys left null: the token arrays' length (data.seq_len), the
    images' size (data.image_size: the larger side; a set size resizes them)."""
    x = datafiles.npz_arrays(datafiles.match_files(d.path)[0])[d.x_key][0]
    if request.images:
        return {"image_size": max(x[1], x[2])} if d.image_size is None else {}
    return {"seq_len": x[1]} if d.seq_len is None else {}


def build(d: DictConfig, request: Request) -> "Examples":
    """An .npz file's x and y, in memory (one copy); validation is a seeded share."""
    import numpy as np
    import tensorflow as tf

    from runner.data.examples import Examples, image_prepare, tensor_bytes

    with np.load(datafiles.match_files(d.path)[0]) as npz:
        x_np, y_np = npz[d.x_key], npz[d.y_key]
    if request.images and x_np.ndim == 3:
        x_np = x_np[..., None]  # [N, H, W] grey
    labels_max, n = int(y_np.max()), len(x_np)
    tokens_max = 0 if request.images else int(x_np.max())
    # One copy on the host, in variables; numpy's is freed here. Measured (32768 32x32x3
    # images, 96 MiB): tf.constant or from_tensor_slices of the arrays kept 2 copies resident
    # (192 MiB), and a tensor captured by the map was copied once more by each iterator; a
    # variable is captured by its handle (100 MiB in all).
    with tf.device("/CPU:0"):
        x = tf.Variable(x_np, trainable=False, name="arrays_x")
        y = tf.Variable(y_np, trainable=False, name="arrays_y")
    del x_np, y_np
    order = np.random.default_rng(request.seed).permutation(n)
    n_val = max(1, int(n * d.val_fraction))
    val_idx, train_idx = order[:n_val], order[n_val:]
    if request.images:
        resize = image_prepare(d.image_size, float(d.pixel_max), request.pixels)
        num_classes = d.num_classes or labels_max + 1

        def prepare(i):  # shuffled as indices: the shuffle buffer holds no images
            return resize(tf.gather(x, i), tf.gather(y, i))

        spec = DataSpec("image", (d.image_size, d.image_size, 3), num_classes)
    else:
        per_token = len(y.shape) == 2
        vocab = d.vocab_size or max(tokens_max, labels_max if per_token else 0) + 1
        num_classes = vocab if per_token else d.num_classes or labels_max + 1

        def prepare(i):
            return tf.cast(tf.gather(x, i), tf.int32), tf.cast(tf.gather(y, i), tf.int32)

        spec = DataSpec("tokens", (x.shape[1],), num_classes, per_token, vocab)
    # The variables are read-only data: a checkpoint of the iterator (which would refuse the
    # stateful gather) need not hold them, they are rebuilt from the file on resume.
    options = tf.data.Options()
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    train = tf.data.Dataset.from_tensor_slices(train_idx).with_options(options)
    val = tf.data.Dataset.from_tensor_slices(val_idx).with_options(options)
    return Examples(train, val, prepare, spec, len(train_idx), tensor_bytes(x) + tensor_bytes(y))
