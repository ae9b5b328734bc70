"""fp32 / mixed / bf16 x accum 1 / 4 on the CPU, for the transformer and MobileNetV2.

Targets (issue 4): peak(batch 8, accum 4) <= 1.15 x peak(batch 8, accum 1) + the
accumulator's bytes, and <= 0.6 x peak(batch 32, accum 1): accumulation buys a large
effective batch for about the memory of a small one.

Every job trains on the same number of examples, so batch 8 at accum 1 runs 4x the optimizer
steps of accum 4: both make the same number of forward-backward passes of 8 examples. The
peak is a maximum over passes, and a pass's peak varies with the order in which the graph
executor's threads run its ops (MobileNetV2, batch 8: ~10 MiB between passes of one run),
so a job with 4x the passes would otherwise tend to find a higher maximum.

With `--repeats N` the jobs run in N interleaved rounds; each ratio is printed with its
bootstrap interval and the verdict taken on its far end (runner/bench/noise.py).
"""

from runner.bench import mib, run_rounds, table
from runner.bench.noise import medians, note, ratio, take_repeats, verdict
from runner.techniques.precision import cpu_note

MODELS = {
    "transformer": ["model=transformer", "model.h=128", "model.layers=4", "data.seq_len=128"],
    # 96x96 keeps MobileNetV2 (alpha 1.0) to seconds a step on 2 cores, float16 included.
    "mobilenet": ["model=mobilenet", "model.version=v2", "data.image_size=96"],
}
PRECISIONS = ("fp32", "mixed", "bf16")
SHAPES = {"b8 accum1": (8, 1), "b8 accum4": (8, 4), "b32 accum1": (32, 1)}


def _jobs(steps: int) -> dict[str, list[str]]:
    """`steps` optimizer steps of batch 8 x accum 4; the other shapes train on as many
    examples."""
    examples = steps * 8 * 4
    return {
        f"{model} {precision} {shape}": [
            *overrides,
            f"precision={precision}",
            f"data.batch_size={b}",
            f"accum={k}",
            f"trainer.max_steps={examples // (b * k)}",
            "data.train_samples=512",
        ]
        for model, overrides in MODELS.items()
        for precision in PRECISIONS
        for shape, (b, k) in SHAPES.items()
    }


def _row(name: str, runs: list[dict]) -> dict:
    r = medians(runs)
    return {
        "job": name,
        "peak_MiB": mib(r["mem/peak_bytes"]),
        "accumulator_MiB": mib(r["mem/estimate/accumulation_bytes"]),
        "step_s": r["speed/step_time_s_p50"],
        "samples_per_s": r["speed/samples_per_s"],
    }


def _accum_line(results: dict, model: str, precision: str) -> str:
    small, acc, big = (results[f"{model} {precision} {s}"] for s in SHAPES)
    ratio_small = ratio(acc, small, "mem/peak_bytes")
    accumulator = medians(acc)["mem/estimate/accumulation_bytes"]
    allowed = 1.15 + accumulator / medians(small)["mem/peak_bytes"]
    ratio_big = ratio(acc, big, "mem/peak_bytes")
    return (
        f"{model:11s} {precision:5s} peak(b8,accum4)/peak(b8,accum1) = {ratio_small} "
        f"(target <= {allowed:.2f} incl. accumulator)   peak(b8,accum4)/peak(b32,accum1) = "
        f"{ratio_big} (target <= 0.6)   {verdict([(ratio_small, allowed), (ratio_big, 0.6)])}"
    )


def _precision_line(results: dict, model: str) -> str:
    base = results[f"{model} fp32 b8 accum1"]
    parts = []
    for precision in ("mixed", "bf16"):
        runs = results[f"{model} {precision} b8 accum1"]
        peak = ratio(runs, base, "mem/peak_bytes")
        parts.append(
            f"{precision}/fp32 peak {peak}, step {ratio(runs, base, 'speed/step_time_s_p50')}"
        )
    return f"{model:11s} at b8 accum1: " + "; ".join(parts)


def main(extra: list[str], steps: int = 6) -> dict[str, list[dict]]:
    """`python -m runner.bench precision_accum [--repeats N] [overrides...]`; returns each
    job's repeats' results, in round order."""
    repeats, extra = take_repeats(extra)
    results = run_rounds(_jobs(steps), extra, repeats)
    print(
        table(
            [_row(n, runs) for n, runs in results.items()],
            ["job", "peak_MiB", "accumulator_MiB", "step_s", "samples_per_s"],
        )
    )
    print("\nGradient accumulation:")
    for model in MODELS:
        for precision in PRECISIONS:
            print(_accum_line(results, model, precision))
    print("\nPrecision (ratios to fp32; a GPU figure is the one that matters, see why below):")
    for model in MODELS:
        print(_precision_line(results, model))
    print(note(repeats))
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        for policy in ("mixed_float16", "mixed_bfloat16"):
            print(f"why: {cpu_note(policy)}")
    return results
