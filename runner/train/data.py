"""tf.data pipelines: a source of examples -> shuffle -> parallel map -> batch -> prefetch.

Each source, named by `data.name`, gives a `Source` (runner/train/source.py): raw examples,
a `prepare` function run in the parallel map, and the `DataSpec` the model is built for.
The built-in ones are here (`synthetic`, `digits`, `image_folder`); a user's files and
functions in runner/train/sources.py (`tfrecord`, `arrays`, `text`) and
runner/train/custom.py (`custom`); docs/data.md is their contract. The training pipeline
yields micro-batches of `data.batch_size`; the train step (runner/techniques/accumulation.py)
draws `accum` of them, one at a time, per optimizer step.
"""

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import psutil
import tensorflow as tf
from omegaconf import DictConfig

from models.spec import DataSpec
from runner.train import custom, sources
from runner.train.source import (
    Source,
    held_bytes,
    image_prepare,
    pixel_range,
    tensor_bytes,
    to_range,
)

AUTOTUNE = tf.data.AUTOTUNE
DIGITS_SEQ_LEN = 64  # 8x8 pixels, read as tokens by the transformer
DIGITS_VOCAB = 17  # pixel intensities 0..16


@dataclass
class Data:
    train: tf.data.Dataset  # (inputs, targets), each [batch_size, ...], repeated
    val: tf.data.Dataset  # (inputs, targets), each [batch_size, ...], one pass
    spec: DataSpec
    train_size: int
    steps_per_epoch: int  # optimizer steps per pass over the training split
    # The process's resident-memory growth over building these pipelines and drawing a first
    # training batch (build_data(measure=True); 0 when not measured): data held in memory
    # shows here, a streamed source's shuffle and prefetch buffers only.
    setup_rss_bytes: int = 0
    # A copy of the training pipeline, made afresh on each call, whose shuffle has a seed
    # state of its own: a second iterator of `train` itself would advance its shuffle's seed
    # state, and the epochs training draws after it would come in another order (measured:
    # trainer.bn_recalibrate's batches drawn that way changed the losses from the 2nd epoch on).
    twin: Callable[[], tf.data.Dataset] | None = None


def _token_table(vocab: int, length: int) -> np.ndarray:
    """Every sequence of the fixed rule x[t+1] = (5 x[t] + 3) mod vocab, one per start token.

    The rule is a permutation of the vocabulary, so the next token is always predictable
    and a language model's loss falls from ln(vocab) towards zero as it learns.
    """
    table = np.zeros((vocab, length), dtype=np.int32)
    table[:, 0] = np.arange(vocab)
    for t in range(1, length):
        table[:, t] = (5 * table[:, t - 1] + 3) % vocab
    return table


def _in_tensorflow(array: np.ndarray) -> tf.Tensor:
    """A tensor of `array` in TensorFlow's allocator, always: tf.constant borrows a numpy
    buffer it finds aligned (a 1 MiB token table was then missing from the allocator's count
    in one process and present in the next), and copies one it does not."""
    return tf.raw_ops.DeepCopy(x=tf.constant(array))


def synthetic(cfg: DictConfig, image_model: bool, seed: int) -> Source:
    """Generated examples: the index of each example seeds its content (stateless, repeatable)."""
    d = cfg.data
    train = tf.data.Dataset.range(d.train_samples)
    val = tf.data.Dataset.range(d.train_samples, d.train_samples + d.val_samples)
    if image_model:
        shape = (d.image_size, d.image_size, 3)
        templates = _in_tensorflow(
            np.random.default_rng(seed).normal(size=(d.num_classes, *shape)).astype(np.float32)
        )
        pixels = pixel_range(cfg)

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
        table = _in_tensorflow(_token_table(d.vocab_size, d.seq_len + 1))

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
    return Source(train, val, prepare, spec, d.train_samples, tensor_bytes(constant))


def digits(cfg: DictConfig, image_model: bool, seed: int) -> Source:
    """scikit-learn's bundled handwritten digits, split train/val by a seeded permutation."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    order = np.random.default_rng(seed).permutation(len(bunch.target))
    n_val = max(1, int(len(order) * cfg.data.val_fraction))
    labels = bunch.target.astype(np.int32)
    if image_model:
        examples = bunch.images.astype(np.float32)[..., None]  # [N, 8, 8, 1], 0..16
        prepare = image_prepare(cfg.data.image_size, 16.0, pixel_range(cfg))
        spec = DataSpec("image", (cfg.data.image_size, cfg.data.image_size, 3), 10)
    else:
        examples = bunch.images.reshape(len(labels), DIGITS_SEQ_LEN).astype(np.int32)

        def prepare(tokens, label):
            return tokens, label

        spec = DataSpec("tokens", (DIGITS_SEQ_LEN,), 10, vocab_size=DIGITS_VOCAB)
    val_idx, train_idx = order[:n_val], order[n_val:]
    train = tf.data.Dataset.from_tensor_slices((examples[train_idx], labels[train_idx]))
    val = tf.data.Dataset.from_tensor_slices((examples[val_idx], labels[val_idx]))
    return Source(train, val, prepare, spec, len(train_idx), examples.nbytes + labels.nbytes)


def image_folder(cfg: DictConfig, image_model: bool, seed: int) -> Source:
    """A user's folder of class sub-folders (keras.utils.image_dataset_from_directory)."""
    import keras

    size = cfg.data.image_size
    train, val = keras.utils.image_dataset_from_directory(
        cfg.data.path,
        label_mode="int",
        image_size=(size, size),
        batch_size=None,
        seed=seed,
        validation_split=cfg.data.val_fraction,
        subset="both",
    )
    spec = DataSpec("image", (size, size, 3), len(train.class_names))
    prepare = image_prepare(size, 255.0, pixel_range(cfg))
    return Source(train, val, prepare, spec, int(train.cardinality()))


SOURCES = {
    "synthetic": synthetic,
    "digits": digits,
    "image_folder": image_folder,
    "tfrecord": sources.tfrecord,
    "arrays": sources.arrays,
    "text": sources.text,
    "custom": custom.custom,
}


def _train_pipeline(source: Source, buffer: int, seed: int, batch: int) -> tf.data.Dataset:
    return (
        source.train.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
        .repeat()
        .map(source.prepare, num_parallel_calls=AUTOTUNE)
        .batch(batch, drop_remainder=True)
        .prefetch(AUTOTUNE)
    )


def build_data(cfg: DictConfig, image_model: bool, replicas: int = 1, measure=False) -> Data:
    """The training and validation pipelines for `cfg.data`; an epoch is `steps_per_epoch`
    optimizer steps of `cfg.accum` micro-batches each. With `replicas` > 1 the training
    micro-batches are global, data.batch_size x replicas (runner/techniques/distribution.py
    gives each replica its part). measure: draw a first batch and record the process's RSS
    growth (Data.setup_rss_bytes): a difference, below 0 when a process that ran jobs before
    gave back more than the data took."""
    if measure:
        gc.collect()  # an earlier job's garbage, freed now rather than inside the measurement
    rss_before = psutil.Process().memory_info().rss
    seed, accum = cfg.trainer.seed, cfg.accum
    batch = cfg.data.batch_size * replicas
    source = SOURCES[cfg.data.name](cfg, image_model, seed)
    steps_per_epoch = source.train_size // (batch * accum)
    if steps_per_epoch < 1:
        over = f" x {replicas} replicas" if replicas > 1 else ""
        raise ValueError(
            f"data.batch_size={cfg.data.batch_size} x accum={accum}{over} needs "
            f"{batch * accum} training examples, data={cfg.data.name} has {source.train_size}"
        )
    buffer = min(cfg.data.shuffle_buffer, source.train_size)
    train = _train_pipeline(source, buffer, seed, batch)
    val = source.val.map(source.prepare, num_parallel_calls=AUTOTUNE)
    val = val.batch(cfg.data.batch_size).prefetch(AUTOTUNE)
    spec = replace(source.spec, held_bytes=held_bytes(source, buffer))
    data = Data(train, val, spec, source.train_size, steps_per_epoch)
    data.twin = lambda: _train_pipeline(source, buffer, seed, batch)
    if measure:
        next(iter(data.twin()))  # a twin's batch: the order training sees is left as it is
        data.setup_rss_bytes = psutil.Process().memory_info().rss - rss_before
    return data
