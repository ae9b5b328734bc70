"""Pieces every model builder shares: the data-kind check, float32 logits, local weights."""

import os
from collections.abc import Callable
from typing import NamedTuple

import keras

from models.spec import DataSpec


def require_kind(spec: DataSpec, kind: str, model: str) -> None:
    """Fail early, in one line, when a model is paired with data it cannot read."""
    if spec.kind != kind:
        noun = "token" if kind == "tokens" else kind
        raise ValueError(
            f"model={model} needs {noun} data (data spec kind={spec.kind!r}); "
            f"pick a data option with kind={kind!r}"
        )


def float32_logits(base: keras.Model) -> keras.Model:
    """Return `base` with a float32 cast after its output, as one flat functional graph.

    Under mixed_float16 the last Dense emits float16 logits, and a softmax/cross-entropy in
    float16 overflows; Keras's mixed-precision guide ends the model with a float32 linear
    Activation. The new model is built on base's own tensors (not by calling base as a layer),
    so its layers stay top-level and can later be cut into segments by name.
    """
    cast = keras.layers.Activation("linear", dtype="float32", name="logits_float32")
    return keras.Model(inputs=base.input, outputs=cast(base.output), name=base.name)


def load_weights(model: keras.Model, weights: str | None) -> keras.Model:
    """Load a local weights file into `model`; never downloads (the machines are offline)."""
    if weights is None:
        return model
    path = os.fspath(weights)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model.weights file not found: {path}")
    model.load_weights(path)
    return model


def build_application(spec: DataSpec, application, model: str, weights=None, **kwargs):
    """Build a keras.applications classifier from scratch for `spec`, with float32 logits.

    weights=None in the application itself: its "imagenet" default would download, and the
    head must have spec.num_classes units anyway. classifier_activation=None leaves logits.
    """
    require_kind(spec, "image", model)
    base = application(
        input_shape=tuple(spec.input_shape),
        include_top=True,
        weights=None,
        classes=spec.num_classes,
        classifier_activation=None,
        **kwargs,
    )
    return load_weights(float32_logits(base), weights)


class Sublayer(NamedTuple):
    """One piece of a layer's computation, for the per-layer profile
    (runner/estimate/layer_rules.py).

    fn(*inputs) -> output in training mode; inputs and output are names in the caller's
    dataflow. kind names the rules runner/estimate/layer_rules.py applies (FLOPs per element,
    what the backward pass keeps). flops: forward FLOPs at the given batch when the kind's rule
    cannot count them; extra_kept: bytes kept for backward beyond the output (a float32 copy, a
    mask); activation: the kind of the layer's own activation (Conv2D(..., activation="relu"):
    "Activation:relu"), "" for none.
    """

    name: str
    kind: str
    fn: Callable
    inputs: tuple[str, ...]
    output: str
    variables: list
    flops: float | None = None
    extra_kept: int = 0
    activation: str = ""


def is_graph(model) -> bool:
    """Whether `model` is a functional graph whose operations can be read (cut into segments,
    walked by the estimate and the layer profile); a subclassed model's `call` cannot."""
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)
