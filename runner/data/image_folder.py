"""data=image_folder: a user's folder of images, one sub-folder per class, read with
keras.utils.image_dataset_from_directory; validation is its seeded share (data.val_fraction).
"""

from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from models.spec import DataSpec
from runner.data import checks
from runner.data.checks import require
from runner.data.contract import Request

if TYPE_CHECKING:  # the build side's: TensorFlow is imported when a build runs
    from runner.data.examples import Examples

KINDS = ("image",)


def check(d: DictConfig, request: Request) -> None:
    checks.val_fraction(d)
    require(
        Path(d.path).is_dir(),
        "data.path",
        d.path,
        "an existing directory with one sub-folder of images per class",
    )


def build(d: DictConfig, request: Request) -> "Examples":
    """A user's folder of class sub-folders (keras.utils.image_dataset_from_directory)."""
    import keras

    from runner.data.examples import Examples, image_prepare

    size = d.image_size
    train, val = keras.utils.image_dataset_from_directory(
        d.path,
        label_mode="int",
        image_size=(size, size),
        batch_size=None,
        seed=request.seed,
        validation_split=d.val_fraction,
        subset="both",
    )
    spec = DataSpec("image", (size, size, 3), len(train.class_names))
    prepare = image_prepare(size, 255.0, request.pixels)
    return Examples(train, val, prepare, spec, int(train.cardinality()))
