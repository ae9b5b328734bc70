"""One plotting style for every picture tfmemlab writes: a bare matplotlib Figure on the Agg
canvas (no pyplot: no global state, no display backend, safe in sweep callbacks and worker
processes), saved at 100 dpi, with labels placed where they cover nothing.
"""

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

# Places tried around a point, in points: eight directions, near ones first.
_DIRECTIONS = ((8, 8), (8, -8), (-8, 8), (-8, -8), (12, 0), (-12, 0), (0, 10), (0, -10))
OFFSETS = [(dx * k, dy * k) for k in (1, 2, 3, 4.5, 6, 8, 10, 13) for dx, dy in _DIRECTIONS]


def figure(width: float, height: float) -> Figure:
    """A Figure of this size (inches) with its own Agg canvas, so that text sizes are known."""
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    return path


def caption(fig: Figure, notes: list[str], fontsize: float = 7) -> None:
    """Lay the figure out with `notes` below it (one line each), or none."""
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=fontsize, wrap=True, va="bottom")
    # The room the notes take, in lines of text as wrapped (about 0.5 em a character), held
    # in inches: a short figure (a bar chart of two jobs) needs a larger share of its height.
    per_line = fig.get_figwidth() * 72 / (0.5 * fontsize)
    lines = sum(1 + len(note) // per_line for note in notes)
    bottom = lines * fontsize * 1.3 / 72 / fig.get_figheight() + 0.01 if notes else 0
    fig.tight_layout(rect=(0, min(bottom, 0.5), 1, 1))


def annotate(ax, xy: tuple[float, float], text: str, offset: tuple[float, float], **style):
    """A label for the point `xy`, `offset` points away, joined to it by a thin line."""
    dx, dy = offset
    style = {
        "fontsize": 7,
        "bbox": {"boxstyle": "round,pad=0.2", "fc": "white", "ec": "0.6", "alpha": 0.85},
        **style,
    }
    line = {"arrowstyle": "-", "color": style.get("color", "0.3"), "lw": 0.6}
    return ax.annotate(
        text,
        xy,
        xytext=offset,
        textcoords="offset points",
        ha="left" if dx > 0 else "right" if dx < 0 else "center",
        va="bottom" if dy > 0 else "top" if dy < 0 else "center",
        arrowprops=line,
        **style,
    )


def label_points(ax, labels: list[tuple], points: list, placed: list | None = None) -> None:
    """Label each (xy, text, style) of `labels` at the place around its point that costs least:
    outside the axes (the text would be clipped) costs most, then covering a label placed before
    or a labelled point (its leader would be hidden), then each other point of `points` covered
    and each step away. `placed`: boxes (display space) of texts already drawn."""
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    every = ax.transData.transform(points) if len(points) else []
    targets = ax.transData.transform([xy for xy, _, _ in labels]) if labels else []
    placed = list(placed or [])
    for xy, text, style in labels:
        costs = []
        for i, offset in enumerate(OFFSETS):
            trial = annotate(ax, xy, text, offset, **style)
            trial.get_window_extent(renderer)  # positions the text for this renderer
            box = Text.get_window_extent(trial).padded(2)  # the words, not the leader line
            trial.remove()
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            clashes = sum(box.overlaps(p) for p in placed) + box.count_contains(targets)
            covered = box.count_contains(every) if len(every) else 0
            cost = 1000 * (not inside) + 100 * clashes + covered + i // 8
            costs.append((cost, i, box))
            if min(costs)[0] <= (i + 1) // 8:
                break  # places further out cost at least this much
        _, best, box = min(costs)
        annotate(ax, xy, text, OFFSETS[best], **style)
        placed.append(box)
