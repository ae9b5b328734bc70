"""Compare runs side by side: a table with ratios to a baseline.

    python -m runner.track.compare --sweep RUN_ID          # the jobs of a sweep (its parent run id)
    python -m runner.track.compare --experiment tfmemlab   # every run of an experiment
    python -m runner.track.compare RUN_ID RUN_ID ...       # chosen runs

Each job is labelled by what differs between it and the baseline (`mixed`, `accum=4`,
`checkpointing=blocks`; the baseline is `baseline`). A ratio to the baseline compares like
with like only if both jobs train at the same effective batch, on the same data, with the same
model: where they do not, the `differs` column names the keys and the ratio is marked `*`.
The tracking URI is `--tracking-uri`, else $MLFLOW_TRACKING_URI, else the embedded default.
The same table ends every sweep, as CSV and Markdown artifacts of its parent run, beside
the pictures runner/report/sweep_plots.py draws from these rows.
"""

import argparse
import csv
from pathlib import Path

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from runner.core.text import cell, table
from runner.track import deploy_compare, spread
from runner.track.client import add_tracking_uri
from runner.track.labels import differs, labels

# (column, metric key, scale); ratios to the baseline are added for the first three.
FIGURES = [
    ("peak_MiB", "mem/peak_bytes", 1 / 2**20),
    ("step_s", "speed/step_time_s_p50", 1.0),
    ("samples_per_s", "speed/samples_per_s", 1.0),
    ("mfu", "speed/mfu", 1.0),
    ("val_accuracy", "val/accuracy", 1.0),
    ("params_M", "params/total", 1e-6),
]
RATIOS = ("peak_MiB", "step_s", "samples_per_s")
# The estimate's parts (mem/estimate/<part>_bytes), kept as est_<part>_MiB in the CSV.
PARTS = ("params", "gradients", "optimizer", "accumulation", "masks", "mask_choice", "data")
PARTS += ("activations", "workspace", "allocator")


def sweep_runs(client: MlflowClient, parent_id: str) -> list[Run]:
    """The jobs of a sweep, in job order: each job's newest run, less runs of a job that a
    resumed sweep ran again (tag `superseded`); with sweep.repeats, each job's own run (its
    repeats are its children, tagged `repeat_of`)."""
    parent = client.get_run(parent_id)
    runs = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.sweep_id = '{parent_id}'"
    )
    newest = {}
    for run in sorted(runs, key=lambda r: r.info.start_time):
        if not {"superseded", "repeat_of"} & run.data.tags.keys():
            newest[run.data.tags.get("job_num", run.info.run_id)] = run
    return sorted(newest.values(), key=lambda r: int(r.data.tags.get("job_num", 0)))


def experiment_runs(client: MlflowClient, name: str) -> list[Run]:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        raise SystemExit(f"error: --experiment={name}: no such experiment")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    # A sweep's parent is no job; a repeat counts in its job's run (runner/track/spread.py).
    return [
        r for r in runs if r.data.tags.get("sweep") != "parent" and "repeat_of" not in r.data.tags
    ]


def rows(runs: list[Run], baseline: str | None = None, varies=(), repeats=None) -> list[dict]:
    """One row per run: its label, status, what differs from the baseline, figures, estimate
    parts and ratios to the baseline run, each ratio with its interval over the jobs'
    repeats (runner/track/spread.py; `repeats[i]`: run i's finished repeats, by default the
    run itself).

    The baseline is the run with that name (or original name, tag `overrides`) or job number,
    else the first finished run. `varies` names the config groups or keys the runs compare on
    purpose (sweep.varies: `model` in +experiment=architectures): a difference there is the
    comparison itself, not a flaw in it, so it is left out of `differs`.
    """
    base = baseline_run(runs, baseline)
    base_params = base.data.params if base else {}
    out = []
    for run, label in zip(runs, labels(runs, base, varies), strict=True):
        metrics, tags = run.data.metrics, run.data.tags
        row = {
            "job": label,
            "job_num": tags.get("job_num", ""),
            "status": run.info.status,
            "repeats": None,  # how many runs its figures are the medians of (spread.py)
            "failure": tags.get("failure", ""),
            "differs": " ".join(differs(run.data.params, base_params, varies)),
            # A resumed run's figures cover the steps after its checkpoint (trainer.resume).
            "covers_steps": tags.get("figures_cover_steps", ""),
            # The model the job kept (runner/track/model.py): mlflow.keras.load_model(uri).
            "model": tags.get("model_uri", ""),
        }
        for column, key, scale in FIGURES:
            row[column] = metrics[key] * scale if key in metrics else None
        for part in PARTS:
            key = f"mem/estimate/{part}_bytes"
            row[f"est_{part}_MiB"] = metrics[key] / 2**20 if key in metrics else None
        out.append(row)
    base_row = next((row for run, row in zip(runs, out, strict=True) if run is base), None)
    for row in out:
        for column in RATIOS:
            ok = base_row and row[column] is not None and base_row[column]
            row[f"{column}/base"] = row[column] / base_row[column] if ok else None
    reps = repeats or [[r] if r.info.status == "FINISHED" else [] for r in runs]
    values = [{c: _values(rs, c) for c in RATIOS} for rs in reps]
    spread.add_intervals(out, values, runs.index(base) if base else None, RATIOS)
    return out


def _values(runs: list[Run], column: str) -> dict[int, float]:
    """The figure `column` of each run that logged it, by round (its `repeat` tag)."""
    key, scale = next((k, s) for c, k, s in FIGURES if c == column)
    return spread.by_round(runs, key, scale)


def baseline_run(runs: list[Run], name: str | None) -> Run | None:
    """The run a comparison divides by: the one of that name (or overrides, or job number),
    else the first finished run."""
    if name is not None:
        for run in runs:
            names = (run.info.run_name, run.data.tags.get("overrides"))
            if name in names or name == run.data.tags.get("job_num"):
                return run
        raise SystemExit(f"error: baseline={name}: no run of that name or job number")
    finished = [r for r in runs if r.info.status == "FINISHED"]
    return finished[0] if finished else None


def columns(out: list[dict], links: bool = False) -> list[str]:
    """The table's columns: everything but the estimate's parts (those go to the CSV) and,
    unless `links`, the models' URIs (in the Markdown, not in the terminal's table)."""
    hidden = {"covers_steps"} | (set() if links else {"model"})
    shown = [c for c in out[0] if not c.startswith("est_") and c not in hidden] if out else []
    return [c for c in shown if not c.endswith(spread.HIDDEN)]  # the ratio's cell says them


def marked(row: dict) -> str:
    """The job's label, with `*` if its ratios do not compare like with like."""
    return row["job"] + (" *" if row["differs"] else "")


def notes(out: list[dict]) -> list[str]:
    """The intervals (or why there are none), then unlike jobs and resumed ones."""
    keys = sorted({k for r in out for k in r["differs"].split()})
    lines = [
        f"{r['job']}: resumed from a checkpoint; its figures cover optimizer steps "
        f"{r['covers_steps']} only."
        for r in out
        if r.get("covers_steps")
    ]
    if keys:
        lines.insert(
            0,
            "(*) not like for like: these jobs differ from the baseline in "
            + ", ".join(keys)
            + " (column `differs`), so their ratios (/base) mix the technique with that "
            "difference.",
        )
    return spread.notes(out, RATIOS) + lines


def _display(out: list[dict], links: bool = False) -> list[dict]:
    """Rows as text, with the ratios of jobs that differ from the baseline marked `*`."""
    shown = []
    for row in out:
        cells = {c: cell(row[c]) for c in columns(out, links)}
        for column in RATIOS:  # with its interval, if any
            cells[f"{column}/base"] = spread.ratio_cell(row, column)
            if row["differs"] and row[f"{column}/base"] is not None:
                cells[f"{column}/base"] += "*"
        shown.append(cells)
    return shown


def text(out: list[dict]) -> str:
    """The table for the terminal, with its notes."""
    return "\n".join([table(_display(out), columns(out)), *notes(out)])


def write_csv(out: list[dict], path: Path) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(out[0]) if out else [])
        writer.writeheader()
        writer.writerows(out)
    return path


def write_markdown(out: list[dict], path: Path) -> Path:
    cols = columns(out, links=True)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in _display(out, links=True)]
    lines += ["", *notes(out)]
    path.write_text("\n".join(lines) + "\n")
    return path


def command_line() -> argparse.ArgumentParser:
    """The command line of `python -m runner.track.compare`."""
    parser = argparse.ArgumentParser(
        prog="python -m runner.track.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_ids", nargs="*")
    parser.add_argument("--sweep", help="parent run id of a sweep")
    parser.add_argument("--experiment", help="experiment name")
    parser.add_argument("--baseline", help="run name or job number to divide by")
    parser.add_argument(
        "--varies",
        nargs="+",
        default=[],
        metavar="KEY",
        help="config groups or keys the runs compare on purpose (e.g. model): left out of "
        "the like-for-like check, as sweep.varies does",
    )
    add_tracking_uri(parser)
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_line()
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
    repeats = spread.finished(client, runs)
    out = rows(runs, args.baseline, args.varies, repeats)
    print(text(out))
    labels = [row["job"] for row in out]
    deployed = deploy_compare.rows(runs, labels, baseline_run(runs, args.baseline), repeats)
    if deployed:  # deploy=litert jobs: what each variant costs where it runs
        print("\n" + deploy_compare.text(deployed, deploy_compare.base_label(out)))
    return out


if __name__ == "__main__":
    main()
