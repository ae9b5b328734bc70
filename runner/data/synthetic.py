"""data=synthetic: generated examples with a learnable target, shaped for the model.

Images whose class is a fixed pattern under noise (CNNs), or token sequences following a fixed
next-token rule (the transformer's language modelling). The index of each example seeds its
content (stateless, repeatable); nothing is read from disk.
"""

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from models.spec import DataSpec
from runner.data.checks import require
from runner.data.contract import Request

if TYPE_CHECKING:  # the build side's: TensorFlow is imported when a build runs
    from runner.data.examples import Examples

KINDS = ("image", "tokens")


def check(d: DictConfig, request: Request) -> None:
    for key in ("num_classes", "vocab_size"):
        require(d[key] >= 2, f"data.{key}", d[key], "a number >= 2")
    per_step = request.per_step
    require(
        d.train_samples >= per_step,
        "data.train_samples",
        d.train_samples,
        f"at least one optimizer step of data (data.batch_size x accum = {per_step})",
    )
    require(d.val_samples >= 1, "data.val_samples", d.val_samples, "a number >= 1")


def token_table(vocab: int, length: int):
    """Every sequence of the fixed rule x[t+1] = (5 x[t] + 3) mod vocab, one per start token.

    The rule is a permutation of the vocabulary, so the next token is always predictable
    and a language model's loss falls from ln(vocab) towards zero as it learns.
    """
    import numpy as np

    table = np.zeros((vocab, length), dtype=np.int32)
    table[:, 0] = np.arange(vocab)
    for t in range(1, length):
        table[:, t] = (5 * table[:, t - 1] + 3) % vocab
    return table


def _in_tensorflow(array):
    """A tensor of `array` in TensorFlow's allocator, always: tf.constant borrows a numpy
    buffer it finds aligned (a 1 MiB token table was then missing from the allocator's count
    in one process and present in the next), and copies one it does not."""
    import tensorflow as tf

    return tf.raw_ops.DeepCopy(x=tf.constant(array))


def build(d: DictConfig, request: Request) -> "Examples":
    """Generated examples: the index of each example seeds its content (stateless, repeatable)."""
    import numpy as np
    import tensorflow as tf

    from runner.data.examples import Examples, tensor_bytes, to_range

    seed = request.seed
    train = tf.data.Dataset.range(d.train_samples)
    val = tf.data.Dataset.range(d.train_samples, d.train_samples + d.val_samples)
    if request.images:
        shape = (d.image_size, d.image_size, 3)
        templates = _in_tensorflow(
            np.random.default_rng(seed).normal(size=(d.num_classes, *shape)).astype(np.float32)
        )
        pixels = request.pixels

        def prepare(index):
            pair = tf.stack([tf.constant(seed, tf.int64), index])
            label = tf.random.stateless_uniform([], pair, 0, d.num_classes, dtype=tf.int32)
            noise = tf.random.stateless_normal(shape, pair + 1)
            # Intensities in [0, 1] like a real image's (mid-grey, template under noise,
            # about 3 standard deviations to black and white), then the model's pixel range.
            image = 0.5 + 0.15 * (0.5 * tf.gather(templates, label) + noise)
            return to_range(tf.clip_by_value(image, 0.0, 1.0), 1.0, pixels), label

        spec, constant = DataSpec("image", shape, d.num_classes), templates
    else:
        table = _in_tensorflow(token_table(d.vocab_size, d.seq_len + 1))

        def prepare(index):
            pair = tf.stack([tf.constant(seed, tf.int64), index])
            start = tf.random.stateless_uniform([], pair, 0, d.vocab_size, dtype=tf.int32)
            sequence = tf.gather(table, start)
            return sequence[:-1], sequence[1:]

        spec = DataSpec(
            "tokens", (d.seq_len,), d.vocab_size, per_token=True, vocab_size=d.vocab_size
        )
        constant = table
    # Every example is drawn from one constant, kept for the run.
    return Examples(train, val, prepare, spec, d.train_samples, tensor_bytes(constant))
