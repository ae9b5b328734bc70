"""The pictures of a sweep's comparison (runner/track/compare.py's rows): peak memory against
throughput, the estimate by part beside each peak, and one bar chart per figure."""

from pathlib import Path

from runner.report import plots
from runner.report.deploy_plots import deploy_pareto
from runner.track import compare, deploy_compare

MARKERS = "osD^vP*Xph"  # hollow and distinct, so that jobs on the same spot stay visible


def report_files(rows: list[dict], out_dir: Path, deployed: list[dict] = ()) -> list[Path]:
    """The comparison as CSV, Markdown and pictures; with `deployed` (deploy=litert jobs,
    runner/track/deploy_compare.py), its deployment table and picture too."""
    paths = [
        compare.write_csv(rows, out_dir / "comparison.csv"),
        compare.write_markdown(rows, out_dir / "comparison.md"),
        *pictures(rows, out_dir),
    ]
    if deployed:
        base = deploy_compare.base_label(rows)
        paths += deploy_compare.write(deployed, out_dir, base)
        fig = deploy_pareto(deployed, [deploy_compare.note(base)])
        paths.append(plots.save(fig, out_dir / "deploy_pareto.png"))
    return paths


def pictures(rows: list[dict], out_dir: Path) -> list[Path]:
    """pareto.png, memory_breakdown.png, and one bar chart per figure, jobs by label."""
    paths = [
        plots.save(pareto(rows), out_dir / "pareto.png"),
        plots.save(memory_breakdown(rows), out_dir / "memory_breakdown.png"),
    ]
    for column, _, _ in compare.FIGURES:
        have = [r for r in rows if r[column] is not None]
        if not have:  # a figure no job logged (mfu without a known peak): no empty chart
            continue
        fig = plots.figure(7, 0.4 * len(have) + 1.5)
        ax = fig.subplots()
        err = _error(have, column)
        ax.barh([compare.marked(r) for r in have], [r[column] for r in have], xerr=err, capsize=4)
        ax.set(xlabel=column, title=column + (SPREAD if err is not None else ""))
        ax.invert_yaxis()
        plots.caption(fig, compare.notes(rows))
        paths.append(plots.save(fig, out_dir / f"bar_{column}.png"))
    return paths


SPREAD = "\n(median of the repeats; error bars: their p10-p90)"


def _error(rows: list[dict], column: str):
    """Error bars from each job's repeats (p10 to p90 around the median), or None when no
    job has more than one repeat."""
    if all(r.get(f"{column}_lo") is None for r in rows):
        return None
    below = [r[column] - (r.get(f"{column}_lo") or r[column]) for r in rows]
    above = [(r.get(f"{column}_hi") or r[column]) - r[column] for r in rows]
    return [below, above]


def pareto(rows: list[dict]):
    """Peak memory (x) against throughput (y): less memory and more samples/s is upper left.
    Jobs on the same spot (bf16 often lands on fp32's on a CPU) keep apart: each has its own
    hollow marker, a later one ringing the earlier, and labels never overlap."""
    done = [r for r in rows if r["peak_MiB"] is not None and r["samples_per_s"] is not None]
    fig = plots.figure(8, 5.5)
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
        xerr, yerr = _error([r], "peak_MiB"), _error([r], "samples_per_s")
        if xerr is not None or yerr is not None:  # each job's spread over its repeats
            ax.errorbar(
                r["peak_MiB"],
                r["samples_per_s"],
                xerr=xerr,
                yerr=yerr,
                fmt="none",
                ecolor=f"C{i % 10}",
                elinewidth=1,
                capsize=3,
            )
    spread = any(_error([r], "samples_per_s") is not None for r in done)
    ax.set(
        xlabel="peak memory (MiB)",
        ylabel="throughput (samples/s)",
        title="memory vs throughput: upper left is better (less memory, more samples/s)"
        + (SPREAD if spread else ""),
    )
    ax.margins(x=0.15, y=0.2)
    ax.grid(alpha=0.3)
    ax.set(xlim=ax.get_xlim(), ylim=ax.get_ylim())  # fixed, so labels can be placed for good
    plots.caption(fig, compare.notes(rows))
    labels = [
        ((r["peak_MiB"], r["samples_per_s"]), compare.marked(r), {"color": f"C{i % 10}"})
        for i, r in enumerate(done)
    ]
    plots.label_points(ax, labels, [xy for xy, _, _ in labels])
    return fig


def _close(a: dict, b: dict, rows: list[dict], column: str) -> bool:
    values = [r[column] for r in rows]
    span = (max(values) - min(values)) or abs(max(values)) or 1.0
    return abs(a[column] - b[column]) <= 0.03 * span


def memory_breakdown(rows: list[dict]):
    """Per job, the estimate stacked by part beside the measured peak: which part a technique
    moved, and how much of the peak the estimate accounts for."""
    have = [r for r in rows if r["est_params_MiB"] is not None and r["peak_MiB"] is not None]
    fig = plots.figure(max(7.0, 1.4 * len(have) + 2.5), 5.5)
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
    plots.caption(fig, compare.notes(rows))
    return fig
