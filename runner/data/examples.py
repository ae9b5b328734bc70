"""What a data source's build gives the pipeline (`Examples`), and the TensorFlow helpers the
sources share: image preparation, byte counts, the every-k-th validation split.

A source reads raw examples; `prepare` (run in tf.data's parallel map) turns one into the
(input, target) pair the model takes; `spec` is the `DataSpec` the model is built for. Images
reach the model in the pixel range it takes (models.spec.input_range): [-1, 1] for
MobileNetV2, raw [0, 255] for the models that rescale pixels themselves.
"""

from collections.abc import Callable
from dataclasses import dataclass

import tensorflow as tf

from models.spec import DataSpec


@dataclass
class Examples:
    train: tf.data.Dataset  # raw examples
    val: tf.data.Dataset
    prepare: Callable  # raw example -> (input, target), run in the parallel map
    spec: DataSpec
    train_size: int
    # What the source itself keeps in memory for the run: a generator's tables, arrays loaded
    # into variables (streamed sources: nothing). In TensorFlow's allocator, beside training
    # on a CPU.
    held_bytes: int = 0


def held_bytes(examples: Examples, buffer: int) -> int:
    """Bytes the input pipeline keeps for the whole run beside its micro-batches: the source's
    own and the shuffle buffer's `buffer` raw examples (its numeric parts: a string's bytes
    live outside TensorFlow's allocator). Measured with a pre-grown pool: 10 templates of
    134x134x3 float32 and the shuffle buffer's indices, 2.059 MiB (2.063 counted); a 4096 x
    1025 int32 token table, 16.022 MiB (16.023); a folder's 96 decoded 96x96 images in the
    shuffle buffer, about 10.4 MiB beside the prefetched micro-batches (10.1)."""
    parts = tf.nest.flatten(examples.train.element_spec)
    known = [s for s in parts if s.dtype != tf.string and s.shape.is_fully_defined()]
    return examples.held_bytes + buffer * sum(tensor_bytes(s) for s in known)


def tensor_bytes(tensor) -> int:
    """Bytes of a tensor, variable or TensorSpec of known shape."""
    return tensor.shape.num_elements() * tensor.dtype.size


def to_range(image: tf.Tensor, scale: float, pixels: tuple[float, float]) -> tf.Tensor:
    """Pixels of [0, scale] mapped linearly onto `pixels` (exactly when it is [0, scale])."""
    low, high = pixels
    return image * ((high - low) / scale) + low


def image_prepare(size: int, scale: float, pixels: tuple[float, float]) -> Callable:
    """Raw pixels of [0, scale] -> size x size x 3 in the model's range `pixels`."""

    def prepare(image, label):
        image = tf.image.resize(tf.cast(image, tf.float32), (size, size))
        if image.shape[-1] == 1:
            image = tf.image.grayscale_to_rgb(image)
        return to_range(image, scale, pixels), tf.cast(label, tf.int32)

    return prepare


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
