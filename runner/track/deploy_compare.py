"""The deployment part of a comparison: one row per job and variant that measured its kept model
where it runs (deploy=litert, runner/deploy/), so that `pruning=none,polynomial,m_by_n
deploy=litert` answers "what did pruning buy at deployment" in one table.

Each row divides by the baseline job's float32 LiteRT file (runner/track/compare.py's baseline):
its file, its gzipped file and its batch-1 latency. With sweep.repeats, a job's figures are its
repeats' medians and each ratio has its 95% bootstrap interval over them, paired by round as
every other ratio of the comparison (runner/track/spread.py); with one repeat there is none.
The latency within one run, with an interval over its measurement rounds, is in the run's own
deploy.md (deploy.rounds).
"""

import csv
from pathlib import Path

from mlflow.entities import Run

from runner.core.text import cell, table
from runner.track import spread

BASE = "float32"  # the variant every row is divided by, of the baseline job
# (column, figure under deploy/<variant>/, scale); the first three get a ratio to the base.
FIGURES = [
    ("file_MiB", "file_bytes", 1 / 2**20),
    ("gzip_MiB", "file_gzip_bytes", 1 / 2**20),
    ("b1_ms", "latency_b1_p50_ms", 1.0),
    ("bN_ms", "latency_batch_p50_ms", 1.0),
    ("RSS_MiB", "rss_growth_bytes", 1 / 2**20),
    ("val_acc", "val_accuracy", 1.0),
    ("agreement", "agreement", 1.0),
]
RATIOS = ("file_MiB", "gzip_MiB", "b1_ms")
SHOWN = ["job", "variant", "file_MiB", "gzip_MiB", "b1_ms", "bN_ms", "RSS_MiB", "val_acc"]
SHOWN += ["agreement", "file/base", "gzip/base", "b1/base", "status"]


def variants(run: Run) -> list[str]:
    """The variants a run measured or tried (deploy/<variant>/status tags), in their order."""
    names = [k.split("/")[1] for k in run.data.tags if k.startswith("deploy/")]
    names = [n for n in names if f"deploy/{n}/status" in run.data.tags]
    order = ["keras", "saved_model", "float32", "float16", "dynamic_int8", "int8", "sparse"]
    return sorted(set(names), key=lambda n: (order.index(n) if n in order else len(order), n))


def rows(runs: list[Run], labels: list[str], base: Run | None, repeats: list[list[Run]]):
    """One row per (job, variant) of the runs that measured a deployment; [] when none did.
    `labels`: each run's label in the comparison; `repeats[i]`: run i's finished repeats."""
    out = []
    base_reps = repeats[runs.index(base)] if base in runs else []
    for run, label, reps in zip(runs, labels, repeats, strict=True):
        for variant in variants(run):
            row = {"job": label, "variant": variant}
            row["status"] = run.data.tags.get(f"deploy/{variant}/status", "")
            for column, figure, scale in FIGURES:
                key = f"deploy/{variant}/{figure}"
                row[column] = run.data.metrics[key] * scale if key in run.data.metrics else None
            for column, figure, scale in FIGURES[:3]:
                name = column.split("_")[0]
                job = spread.by_round(reps, f"deploy/{variant}/{figure}", scale)
                ref = spread.by_round(base_reps, f"deploy/{BASE}/{figure}", scale)
                ok = base is not None and row[column] is not None
                den = base.data.metrics.get(f"deploy/{BASE}/{figure}") if ok else None
                row[f"{name}/base"] = row[column] / (den * scale) if den else None
                interval = spread.interval_of(job, ref) if row[f"{name}/base"] is not None else None
                row[f"{name}/base_lo"], row[f"{name}/base_hi"] = interval or (None, None)
            out.append(row)
    return out


def _ratio(row: dict, name: str) -> str:
    value, lo, hi = (row[f"{name}/base{end}"] for end in ("", "_lo", "_hi"))
    if value is None or lo is None:
        return cell(value)
    noise = f" {spread.NOISE}" if lo <= 1.0 <= hi else ""
    return f"{value:.3g} [{lo:.3g}, {hi:.3g}]{noise}"


def _display(out: list[dict], short: bool = False) -> list[dict]:
    """Rows as text; `short`: a status cut to its first words (`not converted`), for the
    terminal (the Markdown and CSV keep the reason whole)."""
    shown = []
    for row in out:
        cells = {c: cell(row.get(c)) for c in SHOWN}
        if short:
            cells["status"] = cells["status"].split(":")[0]
        for name in ("file", "gzip", "b1"):
            cells[f"{name}/base"] = _ratio(row, name)
        shown.append(cells)
    return shown


def base_label(rows: list[dict]) -> str:
    """The baseline job's label in a comparison's rows (runner/track/labels.py: `baseline`)."""
    return next((row["job"] for row in rows if row["job"] == "baseline"), rows[0]["job"])


def note(baseline: str) -> str:
    return (
        f"deployment: /base divides by the baseline job's ({baseline}) {BASE} LiteRT file; "
        "b1: batch-1 latency p50; each variant measured in a fresh process (deploy.md in each "
        "run has the rest; deploy_comparison.md each reason whole)"
    )


def text(out: list[dict], baseline: str) -> str:
    """The deployment table for the terminal, after the comparison's own."""
    return "\n".join([table(_display(out, short=True), SHOWN), note(baseline)])


def write(out: list[dict], folder: Path, baseline: str) -> list[Path]:
    """deploy_comparison.csv (every column) and deploy_comparison.md (the table's)."""
    csv_path, md_path = folder / "deploy_comparison.csv", folder / "deploy_comparison.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)
    lines = ["| " + " | ".join(SHOWN) + " |", "|" + "---|" * len(SHOWN)]
    lines += ["| " + " | ".join(r[c] for c in SHOWN) + " |" for r in _display(out)]
    md_path.write_text("\n".join([*lines, "", note(baseline)]) + "\n")
    return [csv_path, md_path]
