"""Benchmarks that print figures measured side by side in one run (each job in a fresh process).

    python -m runner.bench overhead          # runner loop vs plain model.fit, same model and data
    python -m runner.bench memory            # peak vs batch size and width, measured vs estimate
    python -m runner.bench estimate          # the estimate over its calibration matrix (18 cells)
    python -m runner.bench estimate --unseen # ... on functional models it was not written for
    python -m runner.bench estimate --draws N [--seed S]  # ... on N jobs drawn at random
    python -m runner.bench precision_accum   # fp32/mixed/bf16 x accum 1/4, transformer and CNN
    python -m runner.bench checkpointing     # checkpointing policies, bf16 attention vs baseline
    python -m runner.bench gpu_check         # transformer fp32 vs mixed vs bf16 on a GPU
    python -m runner.bench layers            # per-layer profile: memory-bound layers' shares
    python -m runner.bench plan              # the planner's predicted peaks against probes
    python -m runner.bench distribution      # 1, 2, 4 replicas and 2 workers at one global batch
    python -m runner.bench attention         # standard vs chunked: whole model, s, budget
    python -m runner.bench attention --core  # ... the attention core alone, against s
    python -m runner.bench ui                # the MLflow UI's memory, as printed vs plain
    python -m runner.bench deploy            # pruning and int8 where the model runs (LiteRT)
    python -m runner.bench structured        # channels removed vs weights zeroed vs dense

Targets are checked here, by ratios of figures measured in the same run, not by timed unit
tests. Extra Hydra overrides after the name apply to every job of the benchmark.
`--repeats N` (checkpointing, precision_accum, overhead) runs the jobs in N interleaved rounds
and prints each ratio with its interval, each verdict taken on its far end (noise.py).
"""

import contextlib
import os
import tempfile
from pathlib import Path

from runner.cli import check_command_line
from runner.config import compose_config
from runner.core.process import in_fresh_process
from runner.core.text import table
from runner.core.units import mib
from runner.track.client import scratch_store

__all__ = ["bench_folder", "mib", "run_jobs", "run_rounds", "table"]


@contextlib.contextmanager
def bench_folder():
    """A throw-away folder the benchmark runs in, its runs' folders (outputs/runs/<id>) and
    store its own: yields (the folder, its store's URI); the working directory is restored."""
    with tempfile.TemporaryDirectory() as tmp:
        here = os.getcwd()
        os.chdir(tmp)
        try:
            yield Path(tmp), f"sqlite:///{tmp}/mlflow.db"
        finally:
            os.chdir(here)


def _run_one(overrides: list[str], config_dir: str | None) -> dict:
    from runner.train.pipeline import run

    return run(compose_config(overrides, config_dir))


def run_jobs(
    jobs: dict[str, list[str]], extra: list[str], config_dir: str | None = None
) -> dict[str, dict]:
    """run(cfg) for each named job, one at a time, each in a fresh process (runner.core.process),
    logged to a throw-away MLflow store; config_dir: a user's config folder, as `python run.py
    --config-dir DIR` adds it."""
    return {name: runs[0] for name, runs in run_rounds(jobs, extra, 1, config_dir).items()}


def run_rounds(
    jobs: dict[str, list[str]], extra: list[str], repeats: int, config_dir: str | None = None
) -> dict[str, list[dict]]:
    """As run_jobs, `repeats` times, interleaved: round r runs every job once, in order, so that
    drift in the machine's load hits every job alike (runner/bench/noise.py); per job, its
    repeats' results in round order. Overrides in `extra` win over the throw-away store's
    (`mlflow.tracking_uri=...` keeps the runs)."""
    results: dict[str, list[dict]] = {name: [] for name in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        common = [
            f"mlflow.tracking_uri={scratch_store(tmp)}",
            "mlflow.experiment=bench",
            "trainer.progress=false",
        ]
        dirs = ["--config-dir", config_dir] if config_dir else []
        for overrides in jobs.values():  # a bad override: one line, before any job starts
            check_command_line([*dirs, *common, *overrides, *extra])
        for r in range(repeats):
            for name, overrides in jobs.items():
                label = name if repeats == 1 else f"{name} (repeat {r})"
                job = common + overrides + extra + [f"mlflow.run_name='{label}'"]
                results[name].append(in_fresh_process(_run_one, job, config_dir))
    return results
