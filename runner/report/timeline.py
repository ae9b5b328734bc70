"""The run's memory timeline: each optimizer step's allocator peak and the bytes held between
steps, beside the estimate (memory_timeline.png)."""

import textwrap
from pathlib import Path

import numpy as np

from runner.report import plots


def timeline_figure(
    step_peaks: list[int],
    held: list[int],
    reference: dict[str, int],
    title: str,
    first_step: int = 1,
):
    """Each optimizer step's peak and the bytes held between steps, on an axis from 0, with
    reference lines (the estimate and its fixed part): how close each step comes to them.
    A resumed run's steps are numbered from `first_step`, the one after its checkpoint.

    Plotting only the bytes held between steps showed noise between 5.28 and 5.32 MiB on a
    job whose steps peaked at 69 MiB (issue 13).
    """
    steps = np.arange(first_step, first_step + len(step_peaks))
    fig = plots.figure(8, 4)
    ax = fig.subplots()
    ax.plot(steps, np.asarray(step_peaks) / 2**20, marker=".", label="peak during the step")
    ax.plot(steps, np.asarray(held) / 2**20, marker=".", label="held between steps")
    styles = iter(["--", ":", "-."])
    for name, value in reference.items():
        ax.axhline(value / 2**20, color="grey", linestyle=next(styles), label=name)
    ax.set_ylim(bottom=0, top=max([*step_peaks, *held, *reference.values(), 1]) / 2**20 * 1.1)
    where = "step 1" if first_step == 1 else f"resumed: step {first_step}"
    ax.set(xlabel=f"optimizer step ({where} traces and compiles)", ylabel="MiB")
    ax.set_title(textwrap.fill(f"allocator memory per step: {title}", 90), fontsize=9)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    return fig


def timeline_png(step_peaks, held, reference, path: Path, title: str, first_step: int = 1) -> Path:
    """timeline_figure, written to `path`."""
    return plots.save(timeline_figure(step_peaks, held, reference, title, first_step), path)
