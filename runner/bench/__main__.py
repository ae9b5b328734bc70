"""python -m runner.bench NAME [overrides...]: see runner/bench/__init__.py."""

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

from runner.core.start import import_tensorflow

BENCHES = (
    "overhead",
    "memory",
    "estimate",
    "precision_accum",
    "checkpointing",
    "gpu_check",
    "layers",
    "plan",
    "distribution",
    "attention",
    "ui",
    "deploy",
    "structured",
)


def usage(name: str) -> str:
    """A benchmark's docstring, read from its file: its commands, without TensorFlow."""
    path = Path(importlib.util.find_spec(f"runner.bench.{name}").origin)
    return ast.get_docstring(ast.parse(path.read_text())) or f"python -m runner.bench {name}"


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in BENCHES:
        raise SystemExit(f"usage: python -m runner.bench {{{','.join(BENCHES)}}} [overrides...]")
    if argv[0] != "attention" and {"-h", "--help"} & set(argv[1:]):  # attention has argparse's
        print(usage(argv[0]))
        return
    import_tensorflow()  # quietly, once, before any benchmark imports it
    importlib.import_module(f"runner.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
