"""data=tfrecord: TFRecord files of tf.train.Example records, streamed (docs/data.md).

The check reads the first record's features (runner/core/datafiles.py) and, for images with
data.num_classes left null, every record's label when the files are under 1 GiB: the classes
are the largest label + 1 (from_files); larger files need data.num_classes. The build
interleaves the files in a fixed, seeded order and parses records in the parallel map, so
memory is bounded by the shuffle and prefetch buffers whatever the files' size. Validation:
data.val_path's files, or every k-th record of the fixed order.
"""

import contextlib
import os
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
# Files whose labels are read, every record, to count the classes when data.num_classes is
# null: under this many bytes in all. A pure-Python parse of every record: 0.8 s for 204 MiB
# of 3 KB records (70,000; the file in the page cache), about 4 s a GiB; smaller records cost
# more a GiB.
LABELS_READ_MAX = 2**30
CLASSES = "the number of label classes (>= 2) for a CNN"


def _all_files(d: DictConfig) -> list[str]:
    more = datafiles.match_files(d.val_path) if d.val_path is not None else []
    return datafiles.match_files(d.path) + more


def _label_range(d: DictConfig) -> tuple[int, int] | None:
    """(smallest, largest) label of data.path's and data.val_path's records, read from the
    files when they are under LABELS_READ_MAX in all; None when they are not."""
    files = _all_files(d)
    if sum(os.path.getsize(f) for f in files) >= LABELS_READ_MAX:
        return None
    try:
        return datafiles.int64_range(files, d.label_key)
    except ValueError as err:
        allowed = f"an int64 feature of one class in every record; {err}"
        raise ConfigError("data.label_key", d.label_key, allowed) from None


def _check_classes(d: DictConfig) -> None:
    """data.num_classes, or (null) the labels of small files, which give it (from_files)."""
    if d.num_classes is not None:
        require(d.num_classes >= 2, "data.num_classes", d.num_classes, CLASSES)
        return
    labels = _label_range(d)
    if labels is None:
        size = sum(os.path.getsize(f) for f in _all_files(d)) / 2**30
        where = d.path if d.val_path is None else f"{d.path} with {d.val_path}"
        allowed = (
            f"{CLASSES}: the labels are read to count them only from files under 1 GiB, and "
            f"{where} holds {size:.1f} GiB"
        )
        raise ConfigError("data.num_classes", None, allowed)
    low, high = labels
    allowed = f"classes 0, 1, ... in every record; the labels of {d.path} reach {low}"
    require(low >= 0, "data.label_key", d.label_key, allowed)
    allowed = f"{CLASSES}; the labels of {d.path} are all {high}"
    require(high >= 1, "data.num_classes", None, allowed)


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
        _check_classes(d)
    else:
        require(d.vocab_size >= 2, "data.vocab_size", d.vocab_size, "a number >= 2")
        count = features[d.tokens_key][1]
        allowed = (
            f"at most {count - 1}: a record holds seq_len + 1 tokens, {files[0]}'s first {count}"
        )
        require(count >= d.seq_len + 1, "data.seq_len", d.seq_len, allowed)
    checks.train_records(d)


def from_files(d: DictConfig, request: Request) -> dict[str, int]:
    """data.num_classes left null for images: the largest label + 1, as data=arrays takes it,
    from files under LABELS_READ_MAX (each read once a process: the check's read is kept)."""
    if not request.images or d.num_classes is not None:
        return {}
    labels = _label_range(d)
    return {} if labels is None else {"num_classes": labels[1] + 1}


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
