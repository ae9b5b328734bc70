"""Benchmarks that print figures measured side by side in one process.

    python -m runner.bench overhead          # runner loop vs plain model.fit, same model and data
    python -m runner.bench memory            # peak vs batch size and width, measured vs estimate
    python -m runner.bench precision_accum   # fp32/mixed/bf16 x accum 1/4, transformer and CNN
    python -m runner.bench checkpointing     # checkpointing policies, bf16 attention vs baseline
    python -m runner.bench gpu_check         # transformer fp32 vs mixed vs bf16 on a GPU
    python -m runner.bench layers            # per-layer profile: memory-bound layers' shares
    python -m runner.bench plan              # the planner's predicted peaks against probes
    python -m runner.bench distribution      # 1, 2, 4 replicas and 2 workers at one global batch

Targets are checked here, by ratios of figures measured in the same run, not by timed unit
tests. Extra Hydra overrides after the name apply to every job of the benchmark.
"""

import multiprocessing
import tempfile

from runner.config import compose_config


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain fixed-width table of rows (dicts) for the terminal."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _run_one(overrides: list[str]) -> dict:
    from runner.train import run

    return run(compose_config(overrides))


def run_jobs(jobs: dict[str, list[str]], extra: list[str]) -> dict[str, dict]:
    """run(cfg) for each named job, one at a time, each in a fresh process, logged to a
    throw-away MLflow store. A fresh process per job: TensorFlow keeps memory for the life
    of a process, and in-process jobs were measured charged for earlier ones."""
    results = {}
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, spawn.Pool(1, maxtasksperchild=1) as pool:
        common = [
            f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
            "mlflow.experiment=bench",
            "trainer.progress=false",
        ]
        for name, overrides in jobs.items():
            job = overrides + extra + common + [f"mlflow.run_name='{name}'"]
            results[name] = pool.apply(_run_one, (job,))
    return results


def mib(n: float) -> float:
    return n / 2**20
