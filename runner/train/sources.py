"""data=arrays, the one source whose build is not yet in runner/data/: an .npz file's x and
y, loaded into memory. It gives `Examples` (runner/data/examples.py) like the others;
docs/data.md is the contract.
"""

import numpy as np
import tensorflow as tf
from omegaconf import DictConfig

from models.spec import DataSpec
from runner.config.model import pixel_range
from runner.core import datafiles
from runner.data.examples import Examples, image_prepare, tensor_bytes


def arrays(cfg: DictConfig, image_model: bool, seed: int) -> Examples:
    """An .npz file's x and y, in memory (one copy); validation is a seeded share."""
    d = cfg.data
    with np.load(datafiles.match_files(d.path)[0]) as npz:
        x_np, y_np = npz[d.x_key], npz[d.y_key]
    if image_model and x_np.ndim == 3:
        x_np = x_np[..., None]  # [N, H, W] grey
    labels_max, n = int(y_np.max()), len(x_np)
    tokens_max = 0 if image_model else int(x_np.max())
    # One copy on the host, in variables; numpy's is freed here. Measured (32768 32x32x3
    # images, 96 MiB): tf.constant or from_tensor_slices of the arrays kept 2 copies resident
    # (192 MiB), and a tensor captured by the map was copied once more by each iterator; a
    # variable is captured by its handle (100 MiB in all).
    with tf.device("/CPU:0"):
        x = tf.Variable(x_np, trainable=False, name="arrays_x")
        y = tf.Variable(y_np, trainable=False, name="arrays_y")
    del x_np, y_np
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(n * d.val_fraction))
    val_idx, train_idx = order[:n_val], order[n_val:]
    if image_model:
        resize = image_prepare(d.image_size, float(d.pixel_max), pixel_range(cfg))
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
