"""Compare runs side by side: a table with ratios to a baseline, and plots.

    python -m runner.compare --sweep RUN_ID          # the jobs of a sweep (its parent run id)
    python -m runner.compare --experiment tfmemlab   # every run of an experiment
    python -m runner.compare RUN_ID RUN_ID ...       # chosen runs

The tracking URI is `--tracking-uri`, else $MLFLOW_TRACKING_URI, else the embedded default.
The same table ends every sweep, as CSV, Markdown and PNG artifacts of its parent run.
"""

import argparse
import csv
import os
from pathlib import Path

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from runner.bench import table
from runner.config import MlflowConfig

DEFAULT_URI = MlflowConfig.tracking_uri  # the embedded default store, as in conf/
# (column, metric key, scale); ratios to the baseline are added for the first three.
FIGURES = [
    ("peak_MiB", "mem/peak_bytes", 1 / 2**20),
    ("step_s", "speed/step_time_s_p50", 1.0),
    ("samples_per_s", "speed/samples_per_s", 1.0),
    ("mfu", "speed/mfu", 1.0),
    ("val_accuracy", "val/accuracy", 1.0),
]
RATIOS = ("peak_MiB", "step_s", "samples_per_s")


def sweep_runs(client: MlflowClient, parent_id: str) -> list[Run]:
    """The jobs of a sweep, in job order."""
    parent = client.get_run(parent_id)
    runs = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.sweep_id = '{parent_id}'"
    )
    return sorted(runs, key=lambda r: int(r.data.tags.get("job_num", 0)))


def experiment_runs(client: MlflowClient, name: str) -> list[Run]:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        raise SystemExit(f"error: --experiment={name}: no such experiment")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return [r for r in runs if r.data.tags.get("sweep") != "parent"]


def rows(runs: list[Run], baseline: str | None = None) -> list[dict]:
    """One row per run: its name, status, figures, and ratios to the baseline run.

    The baseline is the run named `baseline` (or with that job number), else the first
    finished run.
    """
    out = []
    for run in runs:
        metrics, tags = run.data.metrics, run.data.tags
        row = {
            "job": run.info.run_name,
            "job_num": tags.get("job_num", ""),
            "status": run.info.status,
            "failure": tags.get("failure", ""),
        }
        for column, key, scale in FIGURES:
            row[column] = metrics[key] * scale if key in metrics else None
        out.append(row)
    base = _baseline(out, baseline)
    for row in out:
        for column in RATIOS:
            ok = base and row[column] is not None and base[column]
            row[f"{column}/base"] = row[column] / base[column] if ok else None
    return out


def _baseline(out: list[dict], name: str | None) -> dict | None:
    finished = [r for r in out if r["status"] == "FINISHED"]
    if name is not None:
        named = [r for r in out if name in (r["job"], r["job_num"])]
        if not named:
            raise SystemExit(f"error: baseline={name}: no run of that name or job number")
        return named[0]
    return finished[0] if finished else None


def columns(out: list[dict]) -> list[str]:
    return list(out[0]) if out else []


def write_csv(out: list[dict], path: Path) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns(out))
        writer.writeheader()
        writer.writerows(out)
    return path


def write_markdown(out: list[dict], path: Path) -> Path:
    cols = columns(out)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in cols) + " |" for r in out]
    path.write_text("\n".join(lines) + "\n")
    return path


def plots(out: list[dict], out_dir: Path) -> list[Path]:
    """pareto.png (peak memory vs throughput, each job labelled) and one bar chart per figure."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    done = [r for r in out if r["peak_MiB"] is not None and r["samples_per_s"] is not None]
    paths = []
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.scatter([r["peak_MiB"] for r in done], [r["samples_per_s"] for r in done])
    for r in done:
        ax.annotate(r["job"], (r["peak_MiB"], r["samples_per_s"]), fontsize=7)
    ax.set(
        xlabel="peak memory (MiB)",
        ylabel="throughput (samples/s)",
        title="memory vs throughput: lower right is better",
    )
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out_dir / "pareto.png"))
    for column, _, _ in FIGURES:
        have = [r for r in out if r[column] is not None]
        fig, ax = plt.subplots(figsize=(7, 0.4 * len(have) + 1.5))
        ax.barh([r["job"] for r in have], [r[column] for r in have])
        ax.set(xlabel=column, title=column)
        ax.invert_yaxis()
        paths.append(_save(fig, out_dir / f"bar_{column}.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        prog="python -m runner.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_ids", nargs="*")
    parser.add_argument("--sweep", help="parent run id of a sweep")
    parser.add_argument("--experiment", help="experiment name")
    parser.add_argument("--baseline", help="run name or job number to divide by")
    parser.add_argument(
        "--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_URI)
    )
    args = parser.parse_args(argv)
    if sum(map(bool, (args.run_ids, args.sweep, args.experiment))) != 1:
        parser.error("give exactly one of: run ids, --sweep, --experiment")
    client = MlflowClient(tracking_uri=args.tracking_uri)
    if args.sweep:
        runs = sweep_runs(client, args.sweep)
    elif args.experiment:
        runs = experiment_runs(client, args.experiment)
    else:
        runs = [client.get_run(run_id) for run_id in args.run_ids]
    out = rows(runs, args.baseline)
    print(table(out, columns(out)))
    return out


if __name__ == "__main__":
    main()
