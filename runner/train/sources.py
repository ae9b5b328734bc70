"""Sources of a user's own files: TFRecord files, an .npz of arrays, a text file.

Each gives a `Source` (runner/train/source.py) like the built-in ones; runner/train/data.py
shuffles, maps, batches and prefetches it (a user's function: runner/train/custom.py).
docs/data.md is the contract: keys, shapes, how validation is split, and which sources
stream (tfrecord, text: memory bounded by the shuffle buffer, whatever the file's size) or
load into memory (arrays).
"""

import contextlib
import os
import re

import numpy as np
import tensorflow as tf
from omegaconf import DictConfig

from models.spec import DataSpec
from runner.core import datafiles
from runner.core.errors import ConfigError
from runner.train.source import Source, image_prepare, pixel_range, tensor_bytes

AUTOTUNE = tf.data.AUTOTUNE
BYTE_VOCAB = 256  # data=text: a token is a byte
SHORT = "tfmemlab: token record shorter than seq_len + 1"  # the assertion's mark


def every_kth(n: int, val_fraction: float) -> tuple[int, int]:
    """(k, validation examples of n) when every k-th example (index 0, k, 2k, ...) validates."""
    k = max(2, round(1 / val_fraction))
    return k, (n + k - 1) // k


def split_every_kth(ds: tf.data.Dataset, k: int) -> tuple[tf.data.Dataset, tf.data.Dataset]:
    """(train, val) of a dataset in a fixed order: element i validates when i % k == 0. A
    split by index needs no count and no memory; each split reads the whole stream."""
    indexed = ds.enumerate()
    train = indexed.filter(lambda i, _: i % k != 0).map(lambda _, x: x)
    val = indexed.filter(lambda i, _: i % k == 0).map(lambda _, x: x)
    return train, val


def _records(files: list[str], tagged: bool = False) -> tf.data.Dataset:
    """The records of these files, interleaved in a fixed order (never held in memory);
    tagged: each as (record, its file, its index in the file), for the error of a bad one."""
    names = tf.data.Dataset.from_tensor_slices(files)

    def read(name):
        records = tf.data.TFRecordDataset(name)
        return records.enumerate().map(lambda i, r: (r, name, i)) if tagged else records

    return names.interleave(
        read,
        cycle_length=min(4, len(files)),
        num_parallel_calls=AUTOTUNE,
        deterministic=True,  # the every-k-th split and a resumed run see the same order
    )


@contextlib.contextmanager
def short_records(cfg: DictConfig):
    """A token record shorter than seq_len + 1 (the assertion in _tfrecord_parse, raised
    wherever the pipeline is drawn from) as one line naming its file: ConfigError."""
    try:
        yield
    except tf.errors.InvalidArgumentError as err:
        found = re.search(rf"\[{re.escape(SHORT)}\] \[(.*)\] \[(\d+)\] \[(\d+)\]", str(err.message))
        if found is None:
            raise
        path, index, length = found.group(1), int(found.group(2)), int(found.group(3))
        d = cfg.data
        shorter = f"at most {length - 1}, or " if length >= 2 else ""
        raise ConfigError(
            "data.seq_len",
            d.seq_len,
            f"{shorter}records of at least {d.seq_len + 1} tokens (seq_len + 1: the inputs and "
            f"their next-token targets); record {index} of {path} holds {length} under "
            f"data.tokens_key={d.tokens_key}",
        ) from None


def _tfrecord_parse(cfg: DictConfig, image_model: bool):
    """(prepare, spec) for a serialized tf.train.Example."""
    d = cfg.data
    if image_model:
        features = {
            d.image_key: tf.io.FixedLenFeature([], tf.string),
            d.label_key: tf.io.FixedLenFeature([], tf.int64),
        }
        resize = image_prepare(d.image_size, 255.0, pixel_range(cfg))

        def prepare(record):
            example = tf.io.parse_single_example(record, features)
            image = tf.io.decode_image(example[d.image_key], channels=3, expand_animations=False)
            return resize(image, example[d.label_key])

        return prepare, DataSpec("image", (d.image_size, d.image_size, 3), d.num_classes)
    features = {d.tokens_key: tf.io.VarLenFeature(tf.int64)}
    n = d.seq_len + 1

    def prepare(record, path, index):
        tokens = tf.sparse.to_dense(tf.io.parse_single_example(record, features)[d.tokens_key])
        # Only the first record is checked before TensorFlow loads: a shorter one further on
        # stops the run here, named (short_records), not with a shape error.
        length = tf.size(tokens)
        short = tf.debugging.Assert(length >= n, [SHORT, path, index, length], summarize=4)
        with tf.control_dependencies([short]):
            tokens = tf.ensure_shape(tf.cast(tokens[:n], tf.int32), [n])
        return tokens[:-1], tokens[1:]

    return prepare, DataSpec(
        "tokens", (d.seq_len,), d.vocab_size, per_token=True, vocab_size=d.vocab_size
    )


def tfrecord(cfg: DictConfig, image_model: bool, seed: int) -> Source:
    """Streamed records; validation from data.val_path's files, or every k-th record."""
    d = cfg.data
    files = datafiles.match_files(d.path)
    # One seeded file order for the run (not reshuffled: the every-k-th split needs one order).
    files = [files[i] for i in np.random.default_rng(seed).permutation(len(files))]
    prepare, spec = _tfrecord_parse(cfg, image_model)
    n = d.train_records if d.train_records is not None else datafiles.count_records(files)
    tagged = not image_model  # token records: a short one is named (short_records)
    records = _records(files, tagged)
    if d.val_path is not None:
        val_files = datafiles.match_files(d.val_path)
        train, val, train_size = records, _records(val_files, tagged), n
    else:
        k, n_val = every_kth(n, d.val_fraction)
        (train, val), train_size = split_every_kth(records, k), n - n_val
    return Source(train, val, prepare, spec, train_size)


def arrays(cfg: DictConfig, image_model: bool, seed: int) -> Source:
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
    return Source(train, val, prepare, spec, len(train_idx), tensor_bytes(x) + tensor_bytes(y))


def _windows(path: str, size: int, first: int, count: int) -> tf.data.Dataset:
    """`count` windows of `size` bytes from window `first` on, read from the file as needed."""
    total = os.path.getsize(path)
    return tf.data.FixedLengthRecordDataset(
        path, size, header_bytes=first * size, footer_bytes=total - (first + count) * size
    )


def text(cfg: DictConfig, image_model: bool, seed: int) -> Source:
    """Windows of seq_len + 1 bytes (inputs, next-byte targets), streamed from the file; the
    file's last val_fraction of windows validate (text the model has not seen)."""
    d = cfg.data
    path, size = datafiles.match_files(d.path)[0], d.seq_len + 1
    windows = os.path.getsize(path) // size
    n_val = max(1, int(windows * d.val_fraction))
    train = _windows(path, size, 0, windows - n_val)
    val = _windows(path, size, windows - n_val, n_val)

    def prepare(window):
        tokens = tf.cast(tf.io.decode_raw(window, tf.uint8), tf.int32)
        return tokens[:-1], tokens[1:]

    spec = DataSpec("tokens", (d.seq_len,), BYTE_VOCAB, per_token=True, vocab_size=BYTE_VOCAB)
    return Source(train, val, prepare, spec, windows - n_val)
