"""A `_target_` of the user's: `module.attr`, a model's builder or a data function, found in the
current directory or on PYTHONPATH. One rule and one set of reasons for both.

`problem(target)` says what is wrong without running the module (before TensorFlow loads: the
module would import it): not dotted, no such module, or (read from its source) no such name.
`load(target)` imports it when the job is built. Each caller puts the reason under its own key:
`model._target_=... : <reason>` (ModelError), `data._target_=...: not allowed; ...` (ConfigError).
"""

import ast
import difflib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable

from runner.core.errors import error_line

WHERE = "the current directory or on PYTHONPATH"
DOTTED = "expected module.function (or module.Class)"


class TargetError(ValueError):
    """Why a `_target_` cannot be imported: `str(err)` is the reason, one line."""


def import_path() -> None:
    """The current directory on the import path, after PYTHONPATH (`python run.py` puts
    run.py's folder there instead), so a `_target_` beside the user's files is found; a
    spawned child (a probe) inherits it, even after it changes directory."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)


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


def problem(target: str) -> str | None:
    """Why `target` cannot be found, read without running its module (a package's __init__
    runs, as finding a module in it does); None when it can."""
    module, _, attr = str(target).rpartition(".")
    if not module or not attr:
        return DOTTED
    import_path()
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        return f"no module named '{module}' in {WHERE}"
    names = _top_level_names(found.origin) if found.origin else None
    if names is not None and attr not in names:
        close = difflib.get_close_matches(attr, sorted(names), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return f"module '{module}' ({found.origin}) has no '{attr}'{hint}"
    return None


def load(target: str) -> Callable:
    """The function or class `target` names, its module imported; TargetError (the reason)
    when it is not there, or its module fails on import (any error of the user's code)."""
    module, _, attr = str(target).rpartition(".")
    if not module or not attr:
        raise TargetError(DOTTED)
    import_path()
    try:
        found = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as err:  # the module, or one it imports
        raise TargetError(f"{err} in {WHERE}") from None
    except AttributeError:
        raise TargetError(f"module '{module}' has no '{attr}'") from None
    except Exception as err:  # the module itself fails on import
        raise TargetError(f"importing {module} failed: {error_line(err)}") from None
    if not callable(found):
        raise TargetError(f"{target} is {type(found).__name__}, not a function or class")
    return found
