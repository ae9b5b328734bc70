"""The deployment picture of a comparison (runner/track/deploy_compare.py's rows): validation
accuracy against batch-1 latency and against the gzipped file, every variant of every job, so
that what pruning or quantization bought where the model runs, and what it cost in accuracy,
is one look. Upper left is better in both: more accurate, faster or smaller."""

from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from runner.report import plots

MARKERS = {"saved_model": "s", "float32": "o", "float16": "D", "dynamic_int8": "^"}
MARKERS |= {"int8": "v", "sparse": "X", "keras": "*"}
PANELS = (
    ("b1_ms", "batch-1 latency p50 (ms, log scale)", "faster", "batch-1 latency"),
    ("gzip_MiB", "file, gzipped (MiB, log scale)", "smaller", "gzipped file"),
)


def deploy_pareto(rows: list[dict], notes: list[str]):
    """Two panels, accuracy against latency and against size; one colour per job, one marker
    per variant, each point labelled `job: variant`."""
    fig = plots.figure(14, 6.5)
    axes = fig.subplots(1, 2)
    jobs = list(dict.fromkeys(r["job"] for r in rows))
    for ax, (column, xlabel, better, what) in zip(axes, PANELS, strict=True):
        have = [r for r in rows if r.get(column) is not None and r.get("val_acc") is not None]
        for r in have:
            colour = f"C{jobs.index(r['job']) % 10}"
            ax.scatter(
                r[column], r["val_acc"], s=70, marker=MARKERS.get(r["variant"], "P"),
                facecolors="none", edgecolors=colour, linewidths=1.6,
            )  # fmt: skip
        ax.set_xscale("log")
        # 0.2, 0.5, 1, 2, 5: plain numbers (not 2 x 10^-1), three a decade, none crowded
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel=xlabel, ylabel="validation accuracy")
        ax.set_title(f"accuracy vs {what}: upper left is better "
                     f"(more accurate, {better})", fontsize=10)  # fmt: skip
        ax.margins(x=0.25, y=0.15)
        ax.grid(alpha=0.3, which="both")
        ax.set(xlim=ax.get_xlim(), ylim=ax.get_ylim())  # fixed, so labels can be placed for good
        corner = ax.annotate(
            f"better: more accurate, {better}", (0.02, 0.97), xycoords="axes fraction",
            va="top", fontsize=9, color="0.3", fontweight="bold",
        )  # fmt: skip
        taken = [corner.get_window_extent(fig.canvas.get_renderer()).padded(2)]
        labels = [
            ((r[column], r["val_acc"]), f"{r['job']}: {r['variant']}",
             {"color": f"C{jobs.index(r['job']) % 10}", "fontsize": 7})
            for r in have
        ]  # fmt: skip
        plots.label_points(ax, labels, [xy for xy, _, _ in labels], taken)
    plots.caption(fig, notes)
    return fig
