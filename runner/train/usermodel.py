"""Build a model named by `_target_` (the user's own, or keras_app) and check it fits the data.

The builder is called with the data's DataSpec as `spec` and the model YAML's other keys as
keyword arguments (docs/models.md). What comes back must be a keras.Model whose input the data
can feed and whose output has one logit per class (per token for language modelling); each
failure is one line (ModelError), raised before anything trains. A Sequential model comes back
as the functional graph of its layers (the same layers and variables), so that checkpointing,
the estimate and the layer profile can read it; a subclassed model stays as it is.
"""

import inspect

import keras
import numpy as np

from models.common import is_graph
from models.spec import DataSpec
from runner.config.model import RESERVED
from runner.core import targets
from runner.core.errors import ModelError, error_line


def resolve(target: str):
    """The function or class `target` names (module imported from the current directory or
    PYTHONPATH)."""
    try:
        return targets.load(target)
    except targets.TargetError as err:
        raise ModelError(f"model._target_={target}: {err}") from None


def _kwargs(m, builder) -> dict:
    kwargs = {k: v for k, v in m.items() if k not in RESERVED}
    try:
        takes_name = "name" in inspect.signature(builder).parameters
    except (TypeError, ValueError):
        takes_name = False
    if takes_name and m.get("name") is not None:
        kwargs["name"] = m.name
    return kwargs


def _dummy(spec: DataSpec) -> np.ndarray:
    if spec.kind == "tokens":
        return np.zeros((2, *spec.input_shape), dtype=np.int32)
    return np.zeros((2, *spec.input_shape), dtype=np.float32)


def _expected(spec: DataSpec) -> tuple:
    return (spec.seq_len, spec.num_classes) if spec.per_token else (spec.num_classes,)


def _check_input(model: keras.Model, spec: DataSpec, label: str) -> None:
    """A graph's declared input must accept the data's examples (None matches any size)."""
    if len(model.inputs) != 1:
        raise ModelError(f"{label} has {len(model.inputs)} inputs; the data feeds one")
    declared = tuple(model.inputs[0].shape[1:])
    fits = len(declared) == len(spec.input_shape) and all(
        d is None or d == s for d, s in zip(declared, spec.input_shape, strict=True)
    )
    if not fits:
        raise ModelError(
            f"{label} takes inputs of shape {declared}, the data gives {tuple(spec.input_shape)}"
            f" ({spec.kind}); build the input from spec.input_shape"
        )


def check_fits(model, spec: DataSpec, label: str) -> keras.Model:
    """The model, checked against the data (module docstring); a Sequential model as a graph."""
    if not isinstance(model, keras.Model):
        raise ModelError(f"{label} returned {type(model).__name__}, not a keras.Model")
    if is_graph(model) or isinstance(model, keras.Sequential) and model.built:
        _check_input(model, spec, label)
    try:  # builds a subclassed (or unbuilt Sequential) model; checks what it gives
        out = model(_dummy(spec), training=False)
    except Exception as err:
        raise ModelError(
            f"{label} cannot take the data's input {tuple(spec.input_shape)} ({spec.kind}): "
            f"{error_line(err)}"
        ) from None
    got = tuple(getattr(out, "shape", ()))[1:]
    if got != _expected(spec):
        per = " per token" if spec.per_token else ""
        raise ModelError(
            f"{label} outputs shape {got}, the data needs {_expected(spec)}: "
            f"{spec.num_classes} logits{per} (spec.num_classes)"
        )
    values = np.asarray(keras.ops.convert_to_numpy(out), dtype=np.float64)
    if values.min() >= 0 and np.allclose(values.sum(axis=-1), 1.0, atol=1e-3):
        raise ModelError(
            f"{label} outputs probabilities (each row sums to 1: a softmax at its end); "
            "tfmemlab's loss takes logits: end the model without the softmax (activation=None)"
        )
    if isinstance(model, keras.Sequential):  # its layers as one top-level graph
        model = keras.Model(model.inputs, model.outputs, name=model.name)
    return model


def build_target(m, spec: DataSpec) -> keras.Model:
    """cfg.model `m` (with `_target_`) built for `spec` and checked (module docstring)."""
    label = f"model={m.get('name')} ({m._target_})"
    builder = resolve(m._target_)
    try:
        model = builder(spec=spec, **_kwargs(m, builder))
    except ModelError:
        raise
    except Exception as err:
        raise ModelError(f"{label} failed to build: {error_line(err)}") from None
    return check_fits(model, spec, label)
