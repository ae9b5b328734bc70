"""data=digits: scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes).

Real data, no download: CNNs get them resized to data.image_size; the transformer reads the 64
pixels (intensities 0..16) as tokens and the digit as the class. Validation: a seeded share.
"""

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from models.spec import DataSpec
from runner.data import checks
from runner.data.checks import require
from runner.data.contract import Request

if TYPE_CHECKING:  # the build side's: TensorFlow is imported when a build runs
    from runner.data.examples import Examples

KINDS = ("image", "tokens")
SEQ_LEN = 64  # 8x8 pixels, read as tokens by the transformer
VOCAB = 17  # pixel intensities 0..16


def check(d: DictConfig, request: Request) -> None:
    if not request.images:
        allowed = "64 for data=digits (its 8x8 pixels are the tokens)"
        require(d.seq_len == SEQ_LEN, "data.seq_len", d.seq_len, allowed)
    checks.val_fraction(d)


def build(d: DictConfig, request: Request) -> "Examples":
    """scikit-learn's bundled handwritten digits, split train/val by a seeded permutation."""
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    from runner.data.examples import Examples, image_prepare

    bunch = load_digits()
    order = np.random.default_rng(request.seed).permutation(len(bunch.target))
    n_val = max(1, int(len(order) * d.val_fraction))
    labels = bunch.target.astype(np.int32)
    if request.images:
        examples = bunch.images.astype(np.float32)[..., None]  # [N, 8, 8, 1], 0..16
        prepare = image_prepare(d.image_size, 16.0, request.pixels)
        spec = DataSpec("image", (d.image_size, d.image_size, 3), 10)
    else:
        examples = bunch.images.reshape(len(labels), SEQ_LEN).astype(np.int32)

        def prepare(tokens, label):
            return tokens, label

        spec = DataSpec("tokens", (SEQ_LEN,), 10, vocab_size=VOCAB)
    val_idx, train_idx = order[:n_val], order[n_val:]
    train = tf.data.Dataset.from_tensor_slices((examples[train_idx], labels[train_idx]))
    val = tf.data.Dataset.from_tensor_slices((examples[val_idx], labels[val_idx]))
    return Examples(train, val, prepare, spec, len(train_idx), examples.nbytes + labels.nbytes)
