"""What the deployment measurement records into the run: metrics `deploy/<variant>/<figure>`,
tags (each variant's status and file digest, the calibration's digest, what the CPU allows),
the `deploy.md` table as an artifact, and one line printed per variant.

Whether XNNPACK's sparse kernels can run is read from this CPU, not assumed: XNNPACK switches
its sparse inference off on x86-64 CPUs with AVX (its hardware config, src/configs/
hardware-config.c; google/XNNPACK#3170), so a sparse-encoded model is rebuilt dense at load
there and its latency is the dense kernels'; on ARM the sparse path (Elsen et al. 2020, "Fast
Sparse ConvNets") runs float32/float16 1x1 convolutions with >= 2/3 zeros.
"""

import platform
from pathlib import Path

from runner.core.machine import cpu_flags, cpu_model
from runner.core.units import size
from runner.deploy.rounds import ratio_text

KERAS = "keras"  # the reference row: the Keras model itself
NUMBERS = (
    "file_bytes", "file_gzip_bytes", "convert_s", "load_ms", "latency_b1_p50_ms",
    "latency_b1_p90_ms", "latency_batch_p50_ms", "latency_batch_p90_ms", "rss_growth_bytes",
    "tf_peak_bytes", "val_accuracy", "agreement", "max_logit_diff", "logit_scale", "rounds",
    "b1_vs_float32", "b1_vs_float32_lo", "b1_vs_float32_hi", "batch_vs_float32",
    "batch_vs_float32_lo", "batch_vs_float32_hi",
)  # fmt: skip
COLUMNS = [
    ("variant", "variant"), ("file", "file_bytes"), ("gzip", "file_gzip_bytes"),
    ("load ms", "load_ms"), ("b1 p50 ms", "latency_b1_p50_ms"),
    ("b1 p90 ms", "latency_b1_p90_ms"), ("b1 vs float32", "b1_vs_float32"),
    ("bN p50 ms", "latency_batch_p50_ms"), ("bN p90 ms", "latency_batch_p90_ms"),
    ("bN vs float32", "batch_vs_float32"), ("RSS growth", "rss_growth_bytes"),
    ("TF peak", "tf_peak_bytes"), ("val acc", "val_accuracy"), ("agreement", "agreement"),
    ("max abs logit diff", "max_logit_diff"), ("note", "status"),
]  # fmt: skip


def xnnpack_sparse() -> str:
    """One line: whether XNNPACK's sparse kernels can run on this CPU (module docstring)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686", "x86") and "avx" in cpu_flags():
        return (
            "XNNPACK's sparse kernels are off on x86-64 CPUs with AVX (google/XNNPACK#3170): "
            "here a sparse-encoded model is rebuilt dense at load and computed dense"
        )
    if machine in ("aarch64", "arm64") or machine.startswith("arm"):
        return (
            f"XNNPACK's sparse kernels can run on this CPU ({machine}): float32/float16 1x1 "
            "convolutions with >= 2/3 zeros, in a subgraph that starts with a 3x3 stride-2 "
            "convolution with explicit padding"
        )
    return f"XNNPACK's sparse kernels: not known to run on this CPU ({machine})"


def metrics(rows: dict[str, dict]) -> dict[str, float]:
    """Every row's numbers as metrics deploy/<variant>/<figure>."""
    return {
        f"deploy/{variant}/{key}": float(row[key])
        for variant, row in rows.items()
        for key in NUMBERS
        if row.get(key) is not None
    }


def _show(key: str, value, row: dict) -> str:
    if key.endswith("_vs_float32"):
        return ratio_text(row, key) or "-"
    if value is None:
        return "-"
    if key.endswith("_bytes"):
        return size(value)
    if key in ("val_accuracy", "agreement"):
        return f"{value:.2%}" if key == "agreement" else f"{value:.4f}"
    if key == "max_logit_diff":
        return f"{value:.3g}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def table(rows: dict[str, dict], header: list[str], batch: int) -> str:
    """deploy.md: the setting in a few lines, then one row per variant."""
    names = [name.replace("bN", f"b{batch}") for name, _ in COLUMNS]
    lines = [*header, "", "| " + " | ".join(names) + " |"]
    lines.append("|" + "---|" * len(COLUMNS))
    for variant, row in rows.items():
        shown = {**row, "variant": variant, "status": row.get("status", "")}
        cells = [shown["variant"], *(_show(k, shown.get(k), row) for _, k in COLUMNS[1:-1])]
        lines.append("| " + " | ".join([*cells, shown["status"]]) + " |")
    return "\n".join(lines) + "\n"


def line(variant: str, row: dict, rows: dict[str, dict], batch: int) -> str:
    """The variant's summary line, its file and batch-1 latency beside float32 LiteRT's."""
    if variant != KERAS and row.get("status", "measured") != "measured":
        return f"tfmemlab: deploy {variant}: {row['status']}"
    base = rows.get("float32", {})

    def ratio(key: str) -> str:
        ok = variant not in ("float32", KERAS) and base.get(key) and row.get(key) is not None
        return f" ({row[key] / base[key]:.2f}x float32)" if ok else ""

    text = f"tfmemlab: deploy {variant}: {size(row['file_bytes'])}{ratio('file_bytes')}"
    text += f", gzip {size(row['file_gzip_bytes'])}{ratio('file_gzip_bytes')}"
    if variant == KERAS:
        return text + f", val acc {row['val_accuracy']:.4f}, logits up to {row['logit_scale']:.3g}"
    text += f", load {row['load_ms']:.0f} ms"
    text += f", batch 1 p50 {row['latency_b1_p50_ms']:.3g} ms"
    text += f" (p90 {row['latency_b1_p90_ms']:.3g}{_also(ratio_text(row, 'b1_vs_float32'))})"
    text += f", batch {batch} p50 {row['latency_batch_p50_ms']:.3g} ms"
    text += f"{_also(ratio_text(row, 'batch_vs_float32'), ' (')}"
    text += f", RSS +{size(max(row['rss_growth_bytes'], 0))}"
    if row.get("tf_peak_bytes") is not None:
        text += f", TF peak {size(row['tf_peak_bytes'])}"
    text += f", val acc {row['val_accuracy']:.4f}, agreement {row['agreement']:.2%}"
    return text + f", max |logit diff| {row['max_logit_diff']:.3g}"


def _also(text: str, opening: str = "; ") -> str:
    """`text` after `opening` (closed when it opens a bracket), or nothing."""
    if not text:
        return ""
    return opening + text + (")" if opening.endswith("(") else "")


def header(settings: dict, calibration: str | None, train_digest: str | None) -> list[str]:
    """deploy.md's lines above the table: what was measured, how, and on what."""
    out = [
        "# Deployment: the kept model where it runs",
        "",
        f"CPU: {cpu_model()}; {settings['threads']} threads; latency at batch 1 and at batch "
        f"{settings['batch_size']}, untimed calls (at least {settings['warmup']}, for at "
        f"least {settings['warmup_s']} s) then timed ones (at least {settings['repeats']}, "
        f"for at least {settings['min_time_s']} s); each variant in a fresh process, "
        f"{settings['rounds']} round(s) round-robin: figures are the rounds' medians, ratios "
        "to float32 LiteRT with their 95% bootstrap interval over the rounds (paired by round).",
        "Agreement and max abs logit diff: against the Keras model's own outputs on the same "
        "validation inputs (the keras row says how large its logits are). "
        "RSS growth: over loading and the first inferences.",
    ]
    if calibration is not None:
        same = "the" if calibration == train_digest else "NOT the"
        out.append(
            f"int8 calibration: {settings['calibration_batches']} batches of the job's training "
            f"split, digest {calibration} ({same} run's data/train_digest {train_digest})."
        )
    return out


def record(tracker, rows: dict, folder: Path, lines: list[str], tags: dict, batch: int) -> dict:
    """Log the rows into the run (metrics, tags, deploy.md under `lines`, the .tflite files);
    returns the metrics."""
    figures = metrics(rows)
    tracker.log_metrics(figures, step=0)
    tracker.flush()
    for variant, row in rows.items():
        tags[f"deploy/{variant}/status"] = row.get("status", "measured")
        if row.get("sha256"):
            tags[f"deploy/{variant}/sha256"] = row["sha256"]
    tracker.set_tags(tags)
    (folder / "deploy.md").write_text(table(rows, lines, batch))
    tracker.log_artifact(folder / "deploy.md")
    for file in sorted(folder.glob("*.tflite")):
        tracker.log_artifact(file, "deploy")
    return figures
