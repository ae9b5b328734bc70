"""The transformer at one global batch on 1, 2 and 4 replicas (issue 18).

    python -m runner.bench distribution [overrides...]

Jobs: one device; `distribution=mirrored` on 2 and 4 logical CPU devices; and 2 local workers
(`python -m runner.launch --workers 2`, distribution=multi_worker). Each replica takes
GLOBAL / replicas examples of every micro-batch, so every job trains on the same examples.

On a CPU this measures what the strategy costs, not a speedup: the logical devices share the
same cores, and the workers talk over gRPC on 127.0.0.1. Memory: logical CPU devices share one
allocator, so a mirrored job's peak is all its replicas' together; each worker is a process
with its own allocator, so its peak is its one replica's.

Target: the per-replica peak at 2 replicas <= 0.6 x the one-device peak at the same global
batch: data parallelism divides the activations, not the weights and optimizer state.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

from runner.bench import mib, run_jobs, table

MODEL = ["model=transformer", "model.h=128", "model.layers=4", "data.seq_len=128"]
GLOBAL = 32  # examples per micro-batch, over all replicas
REPLICAS = (2, 4)  # mirrored on this many logical CPU devices
WORKERS = 2
TARGET = 0.6
COLUMNS = ["job", "replicas", "batch_per_replica", "step_s", "samples_per_s", "peak_MiB", "of"]


def _common(steps: int) -> list[str]:
    return [*MODEL, f"trainer.max_steps={steps}", "data.train_samples=512"]


def _mirrored_jobs(steps: int) -> dict[str, list[str]]:
    jobs = {"1 device": [*_common(steps), f"data.batch_size={GLOBAL}"]}
    for n in REPLICAS:
        jobs[f"mirrored x{n}"] = [
            *_common(steps),
            "distribution=mirrored",
            f"distribution.logical_cpus={n}",
            f"data.batch_size={GLOBAL // n}",
        ]
    return jobs


def _workers_job(steps: int, extra: list[str]) -> dict:
    """The 2-worker job through runner.launch, its chief's figures read back from the store."""
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{tmp}/mlflow.db"
        overrides = [
            *_common(steps),
            f"data.batch_size={GLOBAL // WORKERS}",
            *extra,
            f"mlflow.tracking_uri={store}",
            "mlflow.experiment=bench",
            "mlflow.run_name=workers",
            "trainer.progress=false",
        ]
        launch = [sys.executable, "-m", "runner.launch", f"--workers={WORKERS}"]
        command = [*launch, f"--dir={Path(tmp) / 'launch'}", "--", *overrides]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench distribution: the workers failed:\n{done.stderr[-3000:]}")
        client = MlflowClient(tracking_uri=store)
        (run,) = client.search_runs([client.get_experiment_by_name("bench").experiment_id])
        return dict(run.data.metrics)


def _row(name: str, r: dict, replicas: int, shared: bool, base: dict) -> dict:
    peak = r["mem/peak_bytes"]
    return {
        "job": name,
        "replicas": replicas,
        "batch_per_replica": GLOBAL // replicas,
        "step_s": r["speed/step_time_s_p50"],
        "samples_per_s": r["speed/samples_per_s"],
        "peak_MiB": mib(peak),
        "of": f"all {replicas} replicas" if shared else "one replica",
        "peak/1 device": peak / base["mem/peak_bytes"],
    }


def main(extra: list[str], steps: int = 8) -> list[dict]:
    results = run_jobs(_mirrored_jobs(steps), extra)
    results[f"{WORKERS} workers"] = _workers_job(steps, extra)
    base = results["1 device"]
    rows = [_row("1 device", base, 1, False, base)]
    rows += [_row(f"mirrored x{n}", results[f"mirrored x{n}"], n, True, base) for n in REPLICAS]
    workers = results[f"{WORKERS} workers"]
    rows.append(_row(f"{WORKERS} workers", workers, WORKERS, False, base))
    print(table(rows, [*COLUMNS, "peak/1 device"]))
    per_replica = [workers[f"mem/peak_bytes_per_replica/{i}"] for i in range(WORKERS)]
    ratio = max(per_replica) / base["mem/peak_bytes"]
    print(
        f"\nper-replica peak at {WORKERS} replicas ({WORKERS} workers, each its own allocator): "
        f"{', '.join(f'{mib(p):.3f}' for p in per_replica)} MiB; largest / 1 device at the "
        f"same global batch of {GLOBAL} = {ratio:.2f} (target <= {TARGET}): "
        f"{'ok' if ratio <= TARGET else 'MISSED'}"
    )
    print(
        "On a CPU these step times are the strategy's cost, not a speedup: the replicas share "
        "the same cores (logical devices) or talk over 127.0.0.1 (workers)."
    )
    return rows
