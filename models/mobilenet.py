"""MobileNet V2 / V3 from keras.applications, trained from scratch on `spec`."""

import keras

from models.common import build_application
from models.spec import MOBILENET_VERSIONS, DataSpec

VERSIONS = dict(
    zip(
        MOBILENET_VERSIONS,
        (
            keras.applications.MobileNetV2,
            keras.applications.MobileNetV3Small,
            keras.applications.MobileNetV3Large,
        ),
        strict=True,
    )
)


def build_mobilenet(spec: DataSpec, version="v2", alpha=1.0, weights=None) -> keras.Model:
    """MobileNet `version` at width `alpha`, with spec.num_classes float32 logits.

    V3 rescales raw [0, 255] pixels itself (include_preprocessing=True by default); V2 has
    no such layer and expects inputs already in [-1, 1]. models.spec.input_range says which,
    for runner/feed/pipelines.py to feed.
    """
    if version not in VERSIONS:
        raise ValueError(f"model.version={version!r} is not one of {sorted(VERSIONS)}")
    return build_application(spec, VERSIONS[version], "mobilenet", weights=weights, alpha=alpha)
