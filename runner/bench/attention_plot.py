"""attention_scaling.png: the whole model's peak and step time against the sequence length s,
standard and chunked attention, on log-log axes with reference slopes of s and s^2 (a line of
slope 1 or 2), so that the s^2 growth of the standard core's scores and the linear growth of
the chunked one read off the picture. Drawn in the project's style (runner/report/plots.py).
"""

from pathlib import Path

from matplotlib.ticker import NullFormatter, NullLocator

from runner.report import plots

STYLE = {"standard": ("C0", "o"), "chunked": ("C1", "s")}
PANELS = (("peak_MiB", "peak (MiB)", "{:.4g}"), ("step_s", "step time p50 (s)", "{:.3g}"))


def _reference(ax, points: list[tuple[int, float]], power: int) -> None:
    """A grey line of slope `power` through the last point, across the points' range, named
    in the legend (dashed: s^2, dotted: s)."""
    (s0, _), (s1, y1) = points[0], points[-1]
    xs = [s0, s1]
    style = {"ls": "--" if power == 2 else ":", "color": "0.45", "lw": 1.0, "zorder": 1}
    label = "slope of s^2" if power == 2 else "slope of s"
    ax.plot(xs, [y1 * (x / s1) ** power for x in xs], label=label, **style)


def scaling(rows: list[dict], title: str, path: Path) -> Path:
    """rows: attention_sweep's (s, attention, peak_MiB, step_s, note)."""
    fig = plots.figure(11, 4.8)
    axes = fig.subplots(1, 2)
    lengths = sorted({r["s"] for r in rows})
    for ax, (key, label, fmt) in zip(axes, PANELS, strict=True):
        labels, every = [], []
        for kind, (color, marker) in STYLE.items():
            points = [(r["s"], r[key]) for r in rows if r["attention"] == kind and key in r]
            if not points:
                continue
            ax.plot(*zip(*points, strict=True), color=color, marker=marker, label=kind, zorder=3)
            labels += [(p, fmt.format(p[1]), {"color": color}) for p in points]
            every += points
            # Memory: s^2 beside standard, s beside chunked. Time: both compute every score,
            # so s^2 beside chunked, the kind measured furthest.
            power = 2 if kind == "standard" or key == "step_s" else 1
            if len(points) > 1 and (key == "peak_MiB" or kind == "chunked"):
                _reference(ax, points, power)
        ax.set(xscale="log", yscale="log", xlabel="sequence length s (tokens)", ylabel=label)
        ax.set_xticks(lengths, [str(s) for s in lengths])
        ax.xaxis.set_minor_locator(NullLocator())  # the lengths only, as plain numbers
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="major", lw=0.4, color="0.85")
        ax.legend(loc="upper left", fontsize=8)
        ax.margins(x=0.08, y=0.15)
        plots.label_points(ax, labels, every)
    fig.suptitle(f"attention against s: {title}", fontsize=9)
    notes = [f"{r['attention']} at s={r['s']}: {r['note']}" for r in rows if r.get("note")]
    notes.append("grey: lines of slope 1 (s) and 2 (s^2) through a kind's longest point")
    plots.caption(fig, notes)
    return plots.save(fig, path)
