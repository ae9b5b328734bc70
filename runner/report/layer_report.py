"""What the per-layer profile (runner/measure/profile.py) leaves in the run: layers.csv, its two
pictures, and its lines in the end-of-run summary."""

import csv
from pathlib import Path

from runner.report import layer_plots

COLUMNS = [
    "name", "type", "output_shape", "params", "activation_bytes", "forward_flops",
    "bytes_read", "bytes_written", "intensity", "bound", "time_s", "time_share",
    "flops_share", "activation_share", "achieved_flops",
]  # fmt: skip


def write(table: list[dict], roof: dict, run_dir: Path, title: str) -> list[Path]:
    """layers.csv, roofline.png and layers.png in the run directory; their paths."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "layers.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    return [
        path,
        layer_plots.roofline_png(
            table, roof["peak_flops"], roof["bandwidth"], run_dir / "roofline.png", title
        ),
        layer_plots.layers_png(table, run_dir / "layers.png", title),
    ]


def summary_lines(figures: dict, table: list[dict]) -> list[str]:
    """The end-of-run summary's lines on the profile."""
    top = sorted(table, key=lambda r: r["activation_bytes"], reverse=True)[:5]
    held = ", ".join(f"{r['name']} {r['activation_bytes'] / 2**20:.1f} MiB" for r in top)
    return [
        "  layers (profiled without XLA, each timed forward+backward in isolation): "
        f"memory-bound layers: {figures['layers/memory_bound_flops_frac']:.0%} of FLOPs, "
        f"{figures['layers/memory_bound_time_frac']:.0%} of time, "
        f"{figures['layers/memory_bound_activation_frac']:.0%} of activations",
        f"  most activation memory: {held}",
        f"  per-layer times add up to {figures['layers/sum_over_step_time']:.2f}x the step "
        f"time without XLA ({figures['layers/step_time_noxla_s'] * 1e3:.1f} ms)",
    ]
