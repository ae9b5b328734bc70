"""data=tfrecord: TFRecord files of tf.train.Example records, streamed (docs/data.md).

The check reads the first record's features and nothing else (runner/core/datafiles.py); the
build interleaves the files in a fixed, seeded order and parses records in the parallel map,
so memory is bounded by the shuffle and prefetch buffers whatever the files' size.
Validation: data.val_path's files, or every k-th record of the fixed order.
"""

import contextlib
import re
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
SHORT = "tfmemlab: token record shorter than seq_len + 1"  # the assertion's mark


def check(d: DictConfig, request: Request) -> None:
    checks.val_fraction(d)
    files = checks.files("data.path", d.path, "a TFRecord file")
    if d.val_path is not None:
        checks.files("data.val_path", d.val_path, "null, or a TFRecord file")
    try:
        features = datafiles.first_features(files[0])
    except (ValueError, IndexError, StopIteration) as err:
        raise ConfigError(
            "data.path", d.path, f"TFRecord files of tf.train.Example ({err})"
        ) from None
    have = ", ".join(f"{k} ({kind})" for k, (kind, _) in sorted(features.items())) or "none"
    need = (
        [("image_key", "bytes"), ("label_key", "int64")]
        if request.images
        else [("tokens_key", "int64")]
    )
    for key, kind in need:
        name = d[key]
        ok = name in features and features[name][0] == kind
        allowed = f"the name of a {kind} feature of {files[0]}'s records; they hold {have}"
        require(ok, f"data.{key}", name, allowed)
    if request.images:
        allowed = "the number of label classes (>= 2) for a CNN"
        require(d.num_classes >= 2, "data.num_classes", d.num_classes, allowed)
    else:
        require(d.vocab_size >= 2, "data.vocab_size", d.vocab_size, "a number >= 2")
        count = features[d.tokens_key][1]
        allowed = (
            f"at most {count - 1}: a record holds seq_len + 1 tokens, {files[0]}'s first {count}"
        )
        require(count >= d.seq_len + 1, "data.seq_len", d.seq_len, allowed)
    checks.train_records(d)


@contextlib.contextmanager
def errors(d: DictConfig):
    """A token record shorter than seq_len + 1 (the assertion in _parse, raised wherever the
    pipeline is drawn from) as one line naming its file: ConfigError."""
    import tensorflow as tf

    try:
        yield
    except tf.errors.InvalidArgumentError as err:
        found = re.search(rf"\[{re.escape(SHORT)}\] \[(.*)\] \[(\d+)\] \[(\d+)\]", str(err.message))
        if found is None:
            raise
        path, index, length = found.group(1), int(found.group(2)), int(found.group(3))
        shorter = f"at most {length - 1}, or " if length >= 2 else ""
        raise ConfigError(
            "data.seq_len",
            d.seq_len,
            f"{shorter}records of at least {d.seq_len + 1} tokens (seq_len + 1: the inputs and "
            f"their next-token targets); record {index} of {path} holds {length} under "
            f"data.tokens_key={d.tokens_key}",
        ) from None


def _records(files: list[str], tagged: bool = False):
    """The records of these files, interleaved in a fixed order (never held in memory);
    tagged: each as (record, its file, its index in the file), for the error of a bad one."""
    import tensorflow as tf

    names = tf.data.Dataset.from_tensor_slices(files)

    def read(name):
        records = tf.data.TFRecordDataset(name)
        return records.enumerate().map(lambda i, r: (r, name, i)) if tagged else records

    return names.interleave(
        read,
        cycle_length=min(4, len(files)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,  # the every-k-th split and a resumed run see the same order
    )


def _parse(d: DictConfig, request: Request):
    """(prepare, spec) for a serialized tf.train.Example."""
    import tensorflow as tf

    from runner.data.examples import image_prepare

    if request.images:
        features = {
            d.image_key: tf.io.FixedLenFeature([], tf.string),
            d.label_key: tf.io.FixedLenFeature([], tf.int64),
        }
        resize = image_prepare(d.image_size, 255.0, request.pixels)

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
        # stops the run here, named (errors), not with a shape error.
        length = tf.size(tokens)
        short = tf.debugging.Assert(length >= n, [SHORT, path, index, length], summarize=4)
        with tf.control_dependencies([short]):
            tokens = tf.ensure_shape(tf.cast(tokens[:n], tf.int32), [n])
        return tokens[:-1], tokens[1:]

    return prepare, DataSpec(
        "tokens", (d.seq_len,), d.vocab_size, per_token=True, vocab_size=d.vocab_size
    )


def build(d: DictConfig, request: Request) -> "Examples":
    """Streamed records; validation from data.val_path's files, or every k-th record."""
    import numpy as np

    from runner.data.examples import Examples, every_kth, split_every_kth

    files = datafiles.match_files(d.path)
    # One seeded file order for the run (not reshuffled: the every-k-th split needs one order).
    files = [files[i] for i in np.random.default_rng(request.seed).permutation(len(files))]
    prepare, spec = _parse(d, request)
    n = d.train_records if d.train_records is not None else datafiles.count_records(files)
    tagged = not request.images  # token records: a short one is named (errors)
    records = _records(files, tagged)
    if d.val_path is not None:
        val_files = datafiles.match_files(d.val_path)
        train, val, train_size = records, _records(val_files, tagged), n
    else:
        k, n_val = every_kth(n, d.val_fraction)
        (train, val), train_size = split_every_kth(records, k), n - n_val
    return Examples(train, val, prepare, spec, train_size)
