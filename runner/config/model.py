"""Models named by `_target_` (the user's own, and keras_app): their name, the data they read,
their pixel range and whether their builder can be found, all known before TensorFlow loads.

A model YAML with `_target_: module.function` (or a class) needs nothing else: its other keys
are the builder's keyword arguments, except the ones reserved here (docs/models.md). The name
that figures, run names and summaries show is `model.name` when the YAML gives one, else the
target's last component (`my_models.unet` -> unet, `build_unet` -> unet).
"""

import difflib

from omegaconf import DictConfig, open_dict

from models.spec import KERAS_APPLICATIONS, UNIT, input_range
from runner.config.schema import IMAGE_MODELS
from runner.core import targets
from runner.core.errors import ModelError

# Keys of a `_target_` model that tfmemlab reads itself; the rest go to the builder. `name` goes
# to it too when its signature has a `name` parameter (keras_app's does).
RESERVED = ("_target_", "name", "input_kind", "input_range")
INPUT_KINDS = ("image", "tokens")
KERAS_APP = "models.keras_app.build_keras_app"


def is_target(m) -> bool:
    """Whether cfg.model `m` names its builder with `_target_` (not a shipped models/<name>.py)."""
    return "_target_" in m


def default_name(target: str) -> str:
    last = target.rsplit(".", 1)[-1]
    return last.removeprefix("build_") or last


def name_model(cfg: DictConfig) -> DictConfig:
    """cfg, with `model.name` set (in place) for a `_target_` model whose YAML gives none, so that
    every place that shows cfg.model.name can."""
    m = cfg.get("model")
    if m is not None and is_target(m) and not m.get("name"):
        with open_dict(cfg):
            cfg.model.name = default_name(m._target_)
    return cfg


def takes_images(cfg: DictConfig) -> bool:
    """Whether the data is to be fed as images (else tokens): a `_target_` model says so with
    model.input_kind (default image); a shipped one by its family."""
    if is_target(cfg.model):
        return cfg.model.get("input_kind", "image") == "image"
    return cfg.model.name in IMAGE_MODELS


def pixel_range(cfg: DictConfig) -> tuple[float, float]:
    """(lowest, highest) pixel value fed to cfg.model: model.input_range for a `_target_` model
    (default [0, 1]; keras_app's YAML says [0, 255]), models.spec.input_range for a shipped one."""
    m = cfg.model
    if is_target(m):
        given = m.get("input_range")
        return UNIT if given is None else (float(given[0]), float(given[1]))
    return input_range(m.name, m.get("version", "v2"))


def check_target(target: str) -> None:
    """ModelError (one line) when `target`'s module is not importable or does not define it;
    read from the module's source, without running it (it would import TensorFlow)."""
    reason = targets.problem(target)
    if reason is not None:
        raise ModelError(f"model._target_={target}: {reason}")


def check_keras_app(name: str) -> None:
    """model=keras_app model.name=...: one of keras.applications' models."""
    if name not in KERAS_APPLICATIONS:
        close = difflib.get_close_matches(str(name), KERAS_APPLICATIONS, n=4, cutoff=0.5)
        hint = f"close: {', '.join(close)}" if close else "see docs/models.md for the list"
        raise ModelError(f"model.name={name}: not a keras.applications model; {hint}")
