"""The two pictures of the per-layer profile (issue 14), from rows shaped like layers.csv's:
each layer under the device's roofline, and the layers that keep the most activation memory
and take the most time. What to show and name is decided by small pure functions, apart from
the drawing, so that it can be tested without reading pixels."""

import math
import textwrap
from pathlib import Path

import numpy as np

from runner.report import plots

MIB = 2**20
MOST_TYPES = 10  # beyond ten colours (tab10) the legend stops telling types apart
# tab10 with its grey (C7) last: only a tenth type, never beside "other", gets grey
TYPE_COLOURS = [f"C{i}" for i in (0, 1, 2, 3, 4, 5, 6, 8, 9, 7)]
BOUND_COLOURS = {"memory": "tab:orange", "compute": "tab:blue"}


def roof(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The most FLOP/s a kernel of this arithmetic intensity can reach on the device: limited by
    memory bandwidth left of the ridge point, by the compute peak right of it (Williams, Waterman
    and Patterson, "Roofline", CACM 2009)."""
    return min(peak_flops, bandwidth * intensity)


def plottable(rows: list[dict]) -> tuple[list[dict], int, float]:
    """The rows that can sit on log-log axes, how many cannot, and those rows' share of the step
    time (their `time_share`, the figure layers.png shows). A layer without FLOPs (padding,
    reshape) has intensity and achieved FLOP/s 0, which a log axis cannot show; hiding them
    silently would hide their time too."""
    kept = [r for r in rows if _on_log_axes(r)]
    left_out = [r for r in rows if not _on_log_axes(r)]
    return kept, len(left_out), sum(r["time_share"] for r in left_out)


def _on_log_axes(row: dict) -> bool:
    return all(math.isfinite(row[k]) and row[k] > 0 for k in ("intensity", "achieved_flops"))


def lost_time(row: dict, peak_flops: float, bandwidth: float) -> float:
    """Seconds the layer spent beyond what the roof allows at its intensity:
    time_s x (1 - achieved / roof(intensity)) = time_s - 3 x forward FLOPs / roof. A slow layer
    far below the roof loses much, a fast one or one on the roof little. With the roof unknown
    (nan), all of its time counts, which ranks the layers by time."""
    ceiling = roof(row["intensity"], peak_flops, bandwidth)
    if not math.isfinite(ceiling) or ceiling <= 0:
        return row["time_s"]
    return row["time_s"] * (1.0 - row["achieved_flops"] / ceiling)


def worst(rows: list[dict], peak_flops: float, bandwidth: float, n: int) -> list[dict]:
    """Up to n layers that lose the most time below the roof, most first; a layer on the roof
    (or above it, where the device's figures are too low) loses nothing and is never named."""
    losses = {id(r): lost_time(r, peak_flops, bandwidth) for r in rows}
    ranked = sorted(rows, key=lambda r: losses[id(r)], reverse=True)
    return [r for r in ranked if losses[id(r)] > 0][:n]


def type_groups(rows: list[dict], most: int = MOST_TYPES) -> dict[str, str]:
    """Each layer type's legend group: the type itself, or "other" for the types that take the
    least time when there are more than `most` of them."""
    time_by_type: dict[str, float] = {}
    for r in rows:
        time_by_type[r["type"]] = time_by_type.get(r["type"], 0.0) + r["time_s"]
    ranked = sorted(time_by_type, key=time_by_type.get, reverse=True)
    kept = ranked if len(ranked) <= most else ranked[: most - 1]
    return {t: t if t in kept else "other" for t in ranked}


def top_rows(rows: list[dict], key: str, n: int) -> list[dict]:
    """The n rows with the largest `key`, largest first; rows where it is 0 are no one's top."""
    return sorted((r for r in rows if r[key] > 0), key=lambda r: r[key], reverse=True)[:n]


def shorten(name: str, width: int = 32) -> str:
    """The name cut in the middle: both the block (start) and the op (end) stay readable."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return name[:head] + "…" + name[len(name) - (width - 1 - head) :]


def roofline_png(
    rows: list[dict],
    peak_flops: float,
    bandwidth: float,
    path: Path,
    title: str,
    label_worst: int = 6,
) -> Path:
    """Each layer's arithmetic intensity (x) against the FLOP/s it achieved (y), on log axes under
    the device's roofline; colour by layer type, marker area by time; the layers that lose the
    most time below the roof are named."""
    kept, n_out, out_share = plottable(rows)
    known = math.isfinite(peak_flops) and math.isfinite(bandwidth)
    fig = plots.figure(10, 6)
    ax = fig.subplots()
    _scatter_by_type(ax, kept)
    _log_axes(ax)
    ax.margins(0.08)  # room for labels beside the outermost points
    placed = _draw_roof(ax, kept, peak_flops, bandwidth) if known else []
    _legend(ax)
    roof_note = "" if known else " (roof unknown: no peak or bandwidth for this device)"
    ax.set_title(textwrap.fill(f"roofline per layer: {title}{roof_note}", 90), fontsize=9)
    plots.caption(fig, _roofline_notes(known, label_worst, n_out, out_share), fontsize=8)
    ax.set(xlim=ax.get_xlim(), ylim=ax.get_ylim())  # fixed, so labels can be placed for good
    unit = "ms lost" if known else "ms"

    def caption(r: dict) -> str:
        return f"{shorten(r['name'], 28)}\n{lost_time(r, peak_flops, bandwidth) * 1e3:.3g} {unit}"

    named = worst(kept, peak_flops, bandwidth, label_worst)
    label_points(ax, named, kept, placed, caption)
    return plots.save(fig, path)


def label_points(ax, named: list[dict], shown: list[dict], texts: list, caption) -> None:
    """Name each layer in `named` beside its point (plots.label_points), clear of the points
    of `shown` and of the texts already drawn."""
    renderer = ax.figure.canvas.get_renderer()
    placed = [t.get_window_extent(renderer) for t in texts]
    labels = [((r["intensity"], r["achieved_flops"]), caption(r), {}) for r in named]
    points = [(r["intensity"], r["achieved_flops"]) for r in shown]
    plots.label_points(ax, labels, points, placed)


def _roofline_notes(known: bool, label_worst: int, n_out: int, out_share: float) -> list[str]:
    notes = [
        f"Named: up to {label_worst} layers that lose the most time below the roof, "
        "time x (1 - achieved / roof at their intensity)."
        if known
        else f"Named: the {label_worst} layers that take the most time."
    ]
    if n_out:
        notes.append(
            f"{n_out} layers with no FLOPs to plot on log axes (e.g. padding, reshape) are left "
            f"out: {out_share:.1%} of the step time."
        )
    return notes


def _scatter_by_type(ax, rows: list[dict]) -> None:
    """One scatter per legend group, the groups that take the most time first (and coloured
    first), "other" last in grey."""
    groups = type_groups(rows)
    names = sorted(dict.fromkeys(groups.values()), key=lambda g: g == "other")  # stable sort
    longest = max((r["time_s"] for r in rows), default=0.0) or 1.0
    for i, group in enumerate(names):
        members = [r for r in rows if groups[r["type"]] == group]
        ax.scatter(
            [r["intensity"] for r in members],
            [r["achieved_flops"] for r in members],
            s=[12 + 300 * r["time_s"] / longest for r in members],
            color="0.55" if group == "other" else TYPE_COLOURS[i],
            alpha=0.75,
            edgecolors="white",
            linewidths=0.5,
            label=group,
        )


def _legend(ax) -> None:
    """Outside the axes, where it covers no point."""
    if not ax.get_legend_handles_labels()[0]:
        return  # nothing plotted: ax.legend would warn
    legend = ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        title="layer type (marker area: time)",
        title_fontsize=8,
    )
    for handle in legend.legend_handles:
        if hasattr(handle, "set_sizes"):  # a scatter's, not the roof's line
            handle.set_sizes([30])  # the legend tells colours apart, not one layer's time


def _log_axes(ax) -> None:
    from matplotlib.ticker import EngFormatter, FuncFormatter, NullFormatter

    ax.set(xscale="log", yscale="log")
    ax.set_xlabel("arithmetic intensity (forward FLOPs per byte read + written)")
    ax.set_ylabel("achieved FLOP/s (3 x forward FLOPs / measured fwd+bwd time)")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # EngFormatter: "100 m"
    ax.yaxis.set_major_formatter(EngFormatter(unit="FLOP/s"))
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())  # minor labels crowd a short log span
    ax.grid(which="major", alpha=0.3)


def _draw_roof(ax, rows: list[dict], peak_flops: float, bandwidth: float) -> list:
    """The roof over the points' span and the ridge point, named above the flat roof where no
    layer can be; returns the ridge label's box, for the layer labels to keep clear of."""
    from matplotlib.ticker import EngFormatter

    ridge = peak_flops / bandwidth
    xs = [r["intensity"] for r in rows] + [ridge]
    grid = np.geomspace(min(xs) / 3, max(xs) * 3, 200)
    eng = EngFormatter(places=0, sep=" ")
    ax.plot(
        grid,
        np.minimum(peak_flops, bandwidth * grid),
        color="black",
        linewidth=1.5,
        zorder=1,
        label=f"roof: min({eng(peak_flops)}FLOP/s, {eng(bandwidth)}B/s x intensity)",
    )
    ax.axvline(ridge, color="black", linestyle=":", linewidth=1, zorder=1)
    ax.plot([ridge], [peak_flops], marker="o", color="black", markersize=5, zorder=3)
    ax.set_ylim(top=max(ax.get_ylim()[1], peak_flops * 3))  # room for the label above the roof
    label = ax.annotate(
        f"ridge point: {ridge:.3g} FLOPs/byte",
        (ridge, peak_flops),
        xytext=(-6, 6),  # up and left: clear of the dotted line, above the sloped roof
        textcoords="offset points",
        ha="right",
        fontsize=8,
    )
    return [label]


def layers_png(rows: list[dict], path: Path, title: str, top: int = 10) -> Path:
    """Side by side, the top layers by activation memory kept for the backward pass and by
    measured time, largest at the top, each bar coloured by what bounds the layer and ending in
    its share of the whole."""
    from matplotlib.patches import Patch

    fig = plots.figure(13, 0.32 * top + 2.2)
    left, right = fig.subplots(1, 2)
    held = top_rows(rows, "activation_bytes", top)
    _bars(left, held, "activation_bytes", MIB, "activation_share", "kept for backward (MiB)")
    left.set_title(f"top {top} by activation memory", fontsize=9)
    slowest = top_rows(rows, "time_s", top)
    _bars(right, slowest, "time_s", 1e-3, "time_share", "measured forward + backward time (ms)")
    right.set_title(f"top {top} by time", fontsize=9)
    handles = [Patch(color=c, label=f"{b}-bound") for b, c in BOUND_COLOURS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(textwrap.fill(f"per-layer profile: {title}", 90), fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return plots.save(fig, path)


def _bars(ax, rows: list[dict], key: str, unit: float, share: str, xlabel: str) -> None:
    values = [r[key] / unit for r in rows]
    ys = range(len(rows))
    bars = ax.barh(ys, values, color=[BOUND_COLOURS.get(r["bound"], "0.55") for r in rows])
    ax.bar_label(bars, [f"{r[share]:.1%}" for r in rows], padding=3, fontsize=7)
    ax.set_yticks(list(ys), [shorten(r["name"]) for r in rows], fontsize=8)
    ax.invert_yaxis()  # largest first, at the top
    ax.set_xlim(0, max(values, default=1.0) * 1.15)  # room for the share after the longest bar
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)
