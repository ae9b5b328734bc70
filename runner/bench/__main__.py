"""python -m runner.bench NAME [overrides...]: see runner/bench/__init__.py."""

import importlib
import sys

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
)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in BENCHES:
        raise SystemExit(f"usage: python -m runner.bench {{{','.join(BENCHES)}}} [overrides...]")
    import_tensorflow()  # quietly, once, before any benchmark imports it
    importlib.import_module(f"runner.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
