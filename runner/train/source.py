"""What every data source gives the pipeline (`Source`), and the image helpers they share.

A source reads raw examples; `prepare` (run in tf.data's parallel map) turns one into the
(input, target) pair the model takes; `spec` is the `DataSpec` the model is built for. Images
reach the model in the pixel range it takes (models.spec.input_range): [-1, 1] for
MobileNetV2, raw [0, 255] for the models that rescale pixels themselves.
"""

from collections.abc import Callable
from dataclasses import dataclass

import tensorflow as tf

from models.spec import DataSpec
from runner.config.model import pixel_range  # noqa: F401  (the sources import it from here)


@dataclass
class Source:
    train: tf.data.Dataset  # raw examples
    val: tf.data.Dataset
    prepare: Callable  # raw example -> (input, target), run in the parallel map
    spec: DataSpec
    train_size: int


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
