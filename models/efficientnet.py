"""EfficientNet B0-B7 and V2 from keras.applications, trained from scratch on `spec`."""

import keras

from models.common import build_application
from models.spec import EFFICIENTNET_VARIANTS, DataSpec

VARIANTS = {
    name: getattr(keras.applications, f"EfficientNet{name}") for name in EFFICIENTNET_VARIANTS
}


def build_efficientnet(spec: DataSpec, variant="B0", weights=None) -> keras.Model:
    """EfficientNet `variant` with spec.num_classes float32 logits.

    Every variant rescales/normalises its input itself, so it takes raw [0, 255] pixels
    (models.spec.input_range, which runner/feed/pipelines.py feeds).
    """
    if variant not in VARIANTS:
        raise ValueError(f"model.variant={variant!r} is not one of {list(VARIANTS)}")
    return build_application(spec, VARIANTS[variant], "efficientnet", weights=weights)
