"""Models named by `_target_` (the user's own, and keras_app): their name, the data they read,
their pixel range and whether their builder can be found, all known before TensorFlow loads.

A model YAML with `_target_: module.function` (or a class) needs nothing else: its other keys
are the builder's keyword arguments, except the ones reserved here (docs/models.md). The name
that figures, run names and summaries show is `model.name` when the YAML gives one, else the
target's last component (`my_models.unet` -> unet, `build_unet` -> unet).
"""

import ast
import difflib
import importlib.util

from omegaconf import DictConfig, open_dict

from models.spec import KERAS_APPLICATIONS, UNIT, input_range
from runner.config.schema import IMAGE_MODELS
from runner.core.datafiles import import_path
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


def _top_level_names(path: str) -> set[str] | None:
    """Names a module's source defines at its top level; None when it cannot be told (a star
    import, a module __getattr__, no source)."""
    try:
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
    return None if "__getattr__" in names else names


def check_target(target: str) -> None:
    """ModelError (one line) when `target`'s module is not importable or does not define it;
    read from the module's source, without running it (it would import TensorFlow)."""
    module, _, attr = str(target).rpartition(".")
    where = "the current directory and PYTHONPATH"
    if not module:
        raise ModelError(f"model._target_={target}: expected module.function (or module.Class)")
    import_path()
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ModelError(f"model._target_={target}: no module named '{module}' in {where}")
    names = _top_level_names(found.origin) if found.origin else None
    if names is not None and attr not in names:
        close = difflib.get_close_matches(attr, sorted(names), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ModelError(
            f"model._target_={target}: module '{module}' ({found.origin}) has no '{attr}'{hint}"
        )


def check_keras_app(name: str) -> None:
    """model=keras_app model.name=...: one of keras.applications' models."""
    if name not in KERAS_APPLICATIONS:
        close = difflib.get_close_matches(str(name), KERAS_APPLICATIONS, n=4, cutoff=0.5)
        hint = f"close: {', '.join(close)}" if close else "see docs/models.md for the list"
        raise ModelError(f"model.name={name}: not a keras.applications model; {hint}")
