"""What a model builder needs to know about the data it will be fed."""

from dataclasses import dataclass


@dataclass(frozen=True)
class DataSpec:
    """Shape of one example and of the target, as produced by `runner.feed.pipelines`.

    kind: "image" (float32 [H, W, 3]) or "tokens" (int32 [seq_len]).
    num_classes: output units of the head (the vocabulary size for language modelling).
    per_token: True when the target is one class per token (language modelling),
        False when it is one class per example.
    vocab_size: number of distinct input tokens (tokens only).
    held_bytes: what the input pipeline keeps in memory for the whole run beside its
        micro-batches (a source's tables or arrays, the shuffle buffer's raw examples), for the
        memory estimate; 0 where nothing is known (a spec built without the data).
    """

    kind: str
    input_shape: tuple
    num_classes: int
    per_token: bool = False
    vocab_size: int = 0
    held_bytes: int = 0

    @property
    def seq_len(self) -> int:
        return self.input_shape[0] if self.kind == "tokens" else 0


# Option names of the image models and the transformer's attention, here (no TensorFlow
# import) so that config validation and the builders share one list.
MOBILENET_VERSIONS = ("v2", "v3_small", "v3_large")
ATTENTION_KINDS = ("standard", "chunked")  # the transformer's model.attention
EFFICIENTNET_VARIANTS = tuple(f"B{i}" for i in range(8)) + tuple(
    f"V2{v}" for v in ("B0", "B1", "B2", "B3", "S", "M", "L")
)

# The pixel range each image model takes, as keras.applications' `preprocess_input` for it
# defines it (keras/src/applications): mobilenet_v2's maps raw [0, 255]
# pixels to [-1, 1]; MobileNetV3 and every EfficientNet rescale raw [0, 255] pixels inside the
# model and their preprocess_input passes pixels through. runner/feed/pipelines.py feeds exactly
# this range, known before the model is built, so a local `model.weights` file sees what it was
# trained on. Raw pixels also survive the in-model rescaling under 16-bit policies: it runs in
# the compute dtype, and MobileNetV3's Rescaling(1/127.5, offset=-1) maps [0, 1] inputs onto
# [-1, -0.992], 3 distinct bfloat16 values (issue 13).
RAW_PIXELS = (0.0, 255.0)
SIGNED_UNIT = (-1.0, 1.0)
# A model of the user's own (a `_target_` in its model YAML) takes [0, 1] pixels unless its
# YAML says otherwise with `input_range: [low, high]` (docs/models.md).
UNIT = (0.0, 1.0)

# keras.applications' models, for `model=keras_app model.name=...` to be checked before
# TensorFlow loads; tests/test_user_models.py compares it with keras.applications itself.
KERAS_APPLICATIONS = (
    "ConvNeXtBase", "ConvNeXtLarge", "ConvNeXtSmall", "ConvNeXtTiny", "ConvNeXtXLarge",
    "DenseNet121", "DenseNet169", "DenseNet201",
    *(f"EfficientNetB{i}" for i in range(8)),
    "EfficientNetV2B0", "EfficientNetV2B1", "EfficientNetV2B2", "EfficientNetV2B3",
    "EfficientNetV2L", "EfficientNetV2M", "EfficientNetV2S",
    "InceptionResNetV2", "InceptionV3", "MobileNet", "MobileNetV2", "MobileNetV3Large",
    "MobileNetV3Small", "NASNetLarge", "NASNetMobile", "ResNet101", "ResNet101V2", "ResNet152",
    "ResNet152V2", "ResNet50", "ResNet50V2", "VGG16", "VGG19", "Xception",
)  # fmt: skip


def input_range(model: str, version: str = "v2") -> tuple[float, float]:
    """(lowest, highest) pixel value of the image `model` (cfg.model.name, its version)."""
    if model == "mobilenet":
        return SIGNED_UNIT if version == "v2" else RAW_PIXELS
    if model == "efficientnet":
        return RAW_PIXELS
    raise ValueError(f"model={model} takes no images")
