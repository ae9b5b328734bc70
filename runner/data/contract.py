"""What the job tells a data source (`Request`), and the source module a `data` config names.

A source reads its own keys from the job's `data` config; the few facts it needs of the rest
of the job come in a Request, so that no source reads the whole config. TensorFlow-free.
"""

import importlib
from dataclasses import dataclass
from types import ModuleType

from runner.core.errors import ConfigError

PARTS = ("KINDS", "check", "build")  # what a source module defines (runner/data/__init__.py)


@dataclass(frozen=True)
class Request:
    images: bool  # the model takes images (else tokens)
    pixels: tuple[float, float] | None = None  # images: the pixel range the model takes
    seed: int = 0  # trainer.seed: splits, file orders and generated examples follow it
    per_step: int = 1  # examples one optimizer step draws (data.batch_size x accum)


def source_module(name: str) -> ModuleType:
    """The module `data.module` names; ConfigError when it is not a data source's."""
    if not name:
        allowed = "the module of the data source, named in its YAML: runner.data.<option>"
        raise ConfigError("data.module", name, allowed)
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        raise ConfigError("data.module", name, f"a data source's module ({err})") from None
    missing = [p for p in PARTS if not hasattr(module, p)]
    if missing:
        allowed = f"a data source's module; {name} has no {', '.join(missing)}"
        raise ConfigError("data.module", name, allowed)
    return module
