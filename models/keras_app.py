"""Any keras.applications model by name (`model=keras_app model.name=DenseNet121`), from scratch.

Each application has its own preprocessing contract (keras/src/applications/imagenet_utils.py
and each application's preprocess_input):
ResNet50 and VGG take caffe-style BGR pixels less the ImageNet means, DenseNet 'torch' mode
(mean/std), MobileNet(V2), Inception and Xception [-1, 1], while ConvNeXt, EfficientNet(V2),
MobileNetV3 and RegNet rescale raw pixels inside the model (their preprocess_input passes them
through). Rather than keep a table of these, the model is fed raw [0, 255] pixels (conf/model/
keras_app.yaml's input_range) and the application's own `preprocess_input` runs as its first
layer, in float32: whatever the contract, the model sees what it was designed for, and a
weights file trained that way loads with the same meaning.
"""

import importlib

import keras

from models.common import float32_logits, load_weights, require_kind
from models.spec import DataSpec


def _preprocess_function(name: str):
    """The preprocess_input of the module that defines keras.applications.<name>."""
    application = getattr(keras.applications, name)
    return importlib.import_module(application.__module__).preprocess_input


@keras.saving.register_keras_serializable("tfmemlab")
class ApplicationPreprocess(keras.layers.Layer):
    """keras.applications.<application>'s preprocess_input, as a layer (saved by name)."""

    def __init__(self, application: str, **kwargs):
        super().__init__(**kwargs)
        self.application = application
        self._fn = _preprocess_function(application)

    def call(self, x):
        return self._fn(x)

    def get_config(self):
        return {**super().get_config(), "application": self.application}


def build_keras_app(spec: DataSpec, name: str = "MobileNetV3Small", weights=None) -> keras.Model:
    """keras.applications.<name> with spec.num_classes float32 logits, its preprocess_input in
    front, as one flat functional graph (checkpointing can cut it at its blocks)."""
    require_kind(spec, "image", f"keras_app ({name})")
    if not hasattr(keras.applications, name):
        raise ValueError(f"model.name={name} is not a keras.applications model")
    inputs = keras.Input(shape=tuple(spec.input_shape), name="pixels")
    x = ApplicationPreprocess(name, dtype="float32", name="preprocess_input")(inputs)
    base = getattr(keras.applications, name)(
        input_tensor=x,
        include_top=True,
        weights=None,  # "imagenet" would download; the head has spec.num_classes units anyway
        classes=spec.num_classes,
        classifier_activation=None,
    )
    return load_weights(float32_logits(keras.Model(inputs, base.output, name=name)), weights)
