"""A Hydra sweep as one MLflow experiment: a parent run, a child run per job, a report.

Registered in conf/config.yaml under hydra.callbacks. At multirun start it creates the
store and the parent run once, before any job starts (a fresh SQLite store created by
several processes at once crashes: shared GUIDE, hydraflow#245), and hands the parent's id to
the jobs through the environment (inherited by joblib's worker processes too). At multirun
end it names each child run by what differs between it and the baseline (the label
runner.track.compare gives it), writes the comparison table (CSV, Markdown) and pictures into the
sweep directory and the parent run, prints the table, and closes the parent run.
"""

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from runner.sweep_resume import read_sweep_file, resume_command, write_sweep_file
from runner.track import compare
from runner.track.tracking import PARENT_ENV, client_for, experiment_id, ui_hint

MARKERS = "osD^vP*Xph"  # hollow and distinct, so that jobs on the same spot stay visible


class SweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        uri = config.mlflow.tracking_uri
        client = client_for(uri)
        sweep_dir = Path(config.hydra.sweep.dir)
        if config.sweep.resume:  # the same parent run, reopened (runner/sweep_resume.py)
            parent_id = read_sweep_file(sweep_dir)["parent_run_id"]
            try:
                parent = client.get_run(parent_id)
            except Exception:
                raise SystemExit(
                    f"error: sweep.resume={sweep_dir}: its parent run {parent_id} is not in "
                    f"{uri}; point MLFLOW_TRACKING_URI at the store the sweep logged to"
                ) from None
            client.update_run(parent_id, status="RUNNING")
            if "stopped" in parent.data.tags:  # by a signal, the last time
                client.delete_tag(parent_id, "stopped")
            client.set_tag(parent_id, "resumed", time.strftime("%Y-%m-%d %H:%M:%S"))
            os.environ[PARENT_ENV] = parent_id
            print(f"tfmemlab: resuming sweep {parent_id} in {sweep_dir} -> {uri}", flush=True)
            return
        experiment = experiment_id(client, config.mlflow.experiment, uri)
        overrides = " ".join(config.hydra.overrides.task)
        parent = client.create_run(
            experiment, run_name=f"sweep: {overrides}", tags={"sweep": "parent"}
        )
        os.environ[PARENT_ENV] = parent.info.run_id
        write_sweep_file(
            sweep_dir,
            parent.info.run_id,
            uri,
            config.mlflow.experiment,
            list(config.hydra.overrides.task),
            list(config.hydra.overrides.hydra),
        )
        print(
            f"tfmemlab: sweep {parent.info.run_id} -> {uri}, experiment "
            f"'{config.mlflow.experiment}'"
        )

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        parent_id = os.environ.pop(PARENT_ENV, None)
        if parent_id is None:
            return
        client = client_for(config.mlflow.tracking_uri)
        runs = compare.sweep_runs(client, parent_id)
        rows = compare.rows(runs, config.sweep.baseline)
        name_runs(client, runs, rows)
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for path in report_files(rows, Path(tmp)):
                client.log_artifact(parent_id, str(path), artifact_path="report")
                (sweep_dir / path.name).write_bytes(path.read_bytes())
        failed = [r["job"] for r in rows if r["status"] != "FINISHED"]
        summary = _summary(config, client, parent_id, rows, failed, sweep_dir)
        # The parent's page in the MLflow UI says in words what the sweep found.
        client.set_tag(parent_id, "mlflow.note.content", summary)
        client.set_tag(parent_id, "failed_jobs", str(len(failed)))
        client.set_terminated(parent_id, status="FINISHED")
        print(summary)


def stop(uri: str, signum: int) -> None:
    """The sweep's process got SIGTERM or SIGINT during the current job, which has checkpointed
    and stopped: mark the parent run KILLED, say how to go on, and exit with 128 + signum
    (the jobs after it do not start)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    sweep_dir, job_num = Path(hydra_cfg.sweep.dir), hydra_cfg.job.num
    parent_id = os.environ.pop(PARENT_ENV, None)
    if parent_id is not None:
        client = client_for(uri)
        name = signal.Signals(signum).name
        client.set_tag(parent_id, "stopped", f"{name} during job {job_num}")
        client.set_terminated(parent_id, status="KILLED")
    print(
        f"tfmemlab: sweep stopped by {signal.Signals(signum).name} during job {job_num}; go on "
        f"with: {resume_command(sweep_dir)}",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(128 + signum)


def _summary(config, client, parent_id, rows, failed, sweep_dir) -> str:
    """The comparison table, where the report is, and how to open the comparison in the UI."""
    uri = config.mlflow.tracking_uri
    experiment = client.get_run(parent_id).info.experiment_id
    command, url = ui_hint(uri, experiment)
    lines = [
        compare.text(rows),
        f"tfmemlab: sweep {parent_id}: {len(rows)} jobs, {len(failed)} failed; report in "
        f"{sweep_dir} and in the parent run's artifacts (report/)",
    ]
    if command:
        lines.append(f"  open the UI: {command}")
    lines.append(f"  then: {url} (expand the parent run '{parent_id}' to compare its jobs)")
    return "\n".join(lines)


def name_runs(client: MlflowClient, runs: list[Run], rows: list[dict]) -> None:
    """Rename each child run to its label; its overrides stay in the tag `overrides`."""
    for run, row in zip(runs, rows, strict=True):
        if run.info.run_name == row["job"]:
            continue
        if "overrides" not in run.data.tags:
            client.set_tag(run.info.run_id, "overrides", run.info.run_name)
        client.update_run(run.info.run_id, name=row["job"])
        # The run's description (its end-of-run summary) names the run: say the new name.
        note = run.data.tags.get("mlflow.note.content")
        if note:
            old = f"run '{run.info.run_name}'"
            new = f"run '{row['job']}' (overrides: {run.info.run_name})"
            client.set_tag(run.info.run_id, "mlflow.note.content", note.replace(old, new))


def report_files(rows: list[dict], out_dir: Path) -> list[Path]:
    return [
        compare.write_csv(rows, out_dir / "comparison.csv"),
        compare.write_markdown(rows, out_dir / "comparison.md"),
        *plots(rows, out_dir),
    ]


def plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """pareto.png, memory_breakdown.png, and one bar chart per figure, jobs by label."""
    paths = [
        _save(pareto(rows), out_dir / "pareto.png"),
        _save(memory_breakdown(rows), out_dir / "memory_breakdown.png"),
    ]
    for column, _, _ in compare.FIGURES:
        have = [r for r in rows if r[column] is not None]
        if not have:  # a figure no job logged (mfu without a known peak): no empty chart
            continue
        fig = _figure(7, 0.4 * len(have) + 1.5)
        ax = fig.subplots()
        ax.barh([compare.marked(r) for r in have], [r[column] for r in have])
        ax.set(xlabel=column, title=column)
        ax.invert_yaxis()
        _finish(fig, compare.notes(rows))
        paths.append(_save(fig, out_dir / f"bar_{column}.png"))
    return paths


def pareto(rows: list[dict]):
    """Peak memory (x) against throughput (y): less memory and more samples/s is upper left.
    Jobs on the same spot (bf16 often lands on fp32's on a CPU) keep apart: each has its own
    hollow marker, a later one ringing the earlier, and labels never overlap."""
    done = [r for r in rows if r["peak_MiB"] is not None and r["samples_per_s"] is not None]
    fig = _figure(8, 5.5)
    ax = fig.subplots()
    sizes = []
    for i, r in enumerate(done):
        same_spot = sum(
            _close(r, other, done, "peak_MiB") and _close(r, other, done, "samples_per_s")
            for other in done[:i]
        )
        sizes.append(90 * 2.2**same_spot)
        ax.scatter(
            r["peak_MiB"],
            r["samples_per_s"],
            s=sizes[-1],
            marker=MARKERS[i % len(MARKERS)],
            facecolors="none",
            edgecolors=f"C{i % 10}",
            linewidths=1.6,
        )
    ax.set(
        xlabel="peak memory (MiB)",
        ylabel="throughput (samples/s)",
        title="memory vs throughput: upper left is better (less memory, more samples/s)",
    )
    ax.margins(x=0.15, y=0.2)
    ax.grid(alpha=0.3)
    ax.set(xlim=ax.get_xlim(), ylim=ax.get_ylim())  # fixed, so labels can be placed for good
    _finish(fig, compare.notes(rows))
    _label_points(fig, ax, done)
    return fig


def _close(a: dict, b: dict, rows: list[dict], column: str) -> bool:
    values = [r[column] for r in rows]
    span = (max(values) - min(values)) or abs(max(values)) or 1.0
    return abs(a[column] - b[column]) <= 0.03 * span


def _label_points(fig, ax, done: list[dict]) -> None:
    """Label each point by its job, moving a label up or down until it overlaps none before."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    renderer = FigureCanvasAgg(fig).get_renderer()
    middle = sum(ax.get_xlim()) / 2
    placed = []
    for i, r in enumerate(done):
        x, y = r["peak_MiB"], r["samples_per_s"]
        right = x > middle  # a label toward the middle stays inside the axes
        for dy in (8, -16, 22, -30, 36, -44, 50, -58, 64, -72):
            label = ax.annotate(
                compare.marked(r),
                (x, y),
                xytext=(-10 if right else 10, dy),
                textcoords="offset points",
                ha="right" if right else "left",
                fontsize=8,
                color=f"C{i % 10}",
                arrowprops={"arrowstyle": "-", "color": f"C{i % 10}", "lw": 0.6},
            )
            label.get_window_extent(renderer)  # positions the label's text for this renderer
            box = Text.get_window_extent(label)  # the words alone, not the leader line
            if not any(box.overlaps(other) for other in placed) or dy == -72:
                break  # free, or out of places to try: keep the last one
            label.remove()
        placed.append(box)


def memory_breakdown(rows: list[dict]):
    """Per job, the estimate stacked by part beside the measured peak: which part a technique
    moved, and how much of the peak the estimate accounts for."""
    have = [r for r in rows if r["est_params_MiB"] is not None and r["peak_MiB"] is not None]
    fig = _figure(max(7.0, 1.4 * len(have) + 2.5), 5.5)
    ax = fig.subplots()
    xs = range(len(have))
    bottom = [0.0] * len(have)
    for i, part in enumerate(compare.PARTS):
        sizes = [r[f"est_{part}_MiB"] or 0.0 for r in have]
        ax.bar([x - 0.2 for x in xs], sizes, 0.38, bottom=bottom, color=f"C{i}", label=part)
        bottom = [b + s for b, s in zip(bottom, sizes, strict=True)]
    peaks = [r["peak_MiB"] for r in have]
    ax.bar([x + 0.2 for x in xs], peaks, 0.38, color="0.3", hatch="//", label="measured peak")
    for x, estimate, peak in zip(xs, bottom, peaks, strict=True):
        if estimate:
            ax.annotate(
                f"{peak / estimate:.2f}x est.",
                (x + 0.2, peak),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                fontsize=7,
            )
    ax.set_xticks(list(xs), [compare.marked(r) for r in have], rotation=15, ha="right")
    ax.set(ylabel="MiB", title="estimate by part (left bar) beside the measured peak (right bar)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    _finish(fig, compare.notes(rows))
    return fig


def _figure(width: float, height: float):
    # A bare Figure, not pyplot: no global state or display backend in sweep callbacks.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def _finish(fig, notes: list[str]) -> None:
    """Lay the figure out, with the table's caveat below it where the picture invites the
    same comparison."""
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=7, wrap=True, va="bottom")
    fig.tight_layout(rect=(0, 0.06 if notes else 0, 1, 1))


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    return path
