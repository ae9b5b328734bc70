"""The data group's schema: what every data source reads (DataConfig), and one class per `data=`
option extending it, which its YAML in conf/data/ names (`base_<option>`). runner.config.store
registers every subclass, so a new source adds its class here and nothing else names it.
Nothing here imports TensorFlow.
"""

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class DataConfig:
    """What every data source reads. Each `data=` option extends it (stored as base_<name>
    by runner.config.store) and names in its YAML the module that checks and builds it."""

    name: str = MISSING
    module: str | None = None  # its YAML names the source's module: runner.data.<name>
    batch_size: int = 32  # the micro-batch fed per step; accum multiplies it
    image_size: int = 32  # CNNs: images are resized to image_size x image_size x 3
    seq_len: int = 64  # transformer: tokens per example
    shuffle_buffer: int = 1024


@dataclass
class SyntheticDataConfig(DataConfig):
    name: str = "synthetic"
    num_classes: int = 10  # image classes
    vocab_size: int = 128  # token vocabulary
    train_samples: int = 2048
    val_samples: int = 256


@dataclass
class DigitsDataConfig(DataConfig):
    name: str = "digits"
    val_fraction: float = 0.2


@dataclass
class ImageFolderDataConfig(DataConfig):
    name: str = "image_folder"
    path: str = MISSING
    val_fraction: float = 0.2


@dataclass
class TFRecordDataConfig(DataConfig):
    """TFRecord files of tf.train.Example records, streamed (docs/data.md)."""

    name: str = "tfrecord"
    path: str = MISSING  # a file or a glob of TFRecord files (uncompressed)
    val_path: str | None = None  # a glob of validation files; null: every k-th record of path
    val_fraction: float = 0.2  # without val_path: k = round(1 / val_fraction)
    image_key: str = "image"  # CNNs: encoded PNG or JPEG bytes
    label_key: str = "label"  # CNNs: an int64 class in 0..num_classes-1
    tokens_key: str = "tokens"  # transformer: >= seq_len + 1 int64 tokens, next-token targets
    # CNNs: the number of label classes (>= 2); null: the largest label + 1, read from the
    # files when under 1 GiB in all (runner/data/tfrecord.py), else required
    num_classes: int | None = None
    vocab_size: int = 256  # transformer: token ids 0..vocab_size-1
    train_records: int | None = None  # records in path's files; null: counted (lengths only)


@dataclass
class ArraysDataConfig(DataConfig):
    """Arrays x and y of an .npz file, loaded into memory (docs/data.md)."""

    name: str = "arrays"
    path: str = MISSING  # an .npz file
    image_size: int | None = None  # images; null: their size in the file (at least 32 for a
    # keras.applications model, which refuses smaller inputs)
    seq_len: int | None = None  # tokens; null: the length of the token arrays
    x_key: str = "x"  # images [N, H, W(, C)] or tokens [N, seq_len]
    y_key: str = "y"  # labels [N], or per-token targets [N, seq_len]
    val_fraction: float = 0.2
    pixel_max: float = 255.0  # images: x spans [0, pixel_max]
    num_classes: int | None = None  # null: the largest label + 1
    vocab_size: int | None = None  # tokens; null: the largest token + 1


@dataclass
class TextDataConfig(DataConfig):
    """A text file as byte-level tokens for language modelling, streamed (docs/data.md)."""

    name: str = "text"
    path: str = MISSING  # a text file (any bytes: the vocabulary is the 256 byte values)
    val_fraction: float = 0.1  # the file's last windows


@dataclass
class CustomDataConfig(DataConfig):
    """A user's function returning a tf.data.Dataset of (input, target) (docs/data.md)."""

    name: str = "custom"
    _target_: str = MISSING  # a dotted path, pkg.module.function
    kwargs: dict[str, Any] = field(default_factory=dict)  # the function's arguments
    val_fraction: float = 0.2  # when the function returns one dataset: every k-th element
    train_records: int | None = None  # elements of its training split; null: counted
    pixel_max: float = 255.0  # images: pixels span [0, pixel_max]
    num_classes: int | None = None  # per-example targets: the classes (required)
    vocab_size: int | None = None  # tokens: ids 0..vocab_size-1 (required)
