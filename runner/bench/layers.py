"""Which layers are memory-bound, and what they cost: the per-layer profile (issue 14).

MobileNetV2 at 224x224, batch 16, and the transformer at h=256, 4 layers, 256 tokens, batch
8, each under fp32 and bf16, one process per job, with profile.layers=true. For each: the
top-10 layers by time, the memory-bound shares of FLOPs, time and activations, and the sum
of per-layer times against the step time without XLA (target: 0.7-1.3x).
"""

from runner.bench import mib, run_jobs, table

MODELS = {
    "mobilenet": [
        "model=mobilenet",
        "model.version=v2",
        "data.image_size=224",
        "data.batch_size=16",
    ],
    "transformer": [
        "model=transformer",
        "model.h=256",
        "model.layers=4",
        "model.heads=4",
        "data.seq_len=256",
        "data.batch_size=8",
        "data.vocab_size=256",
    ],
}
PRECISIONS = ("fp32", "bf16")
COLUMNS = ["name", "type", "bound", "intensity", "time_ms", "time%", "flops%", "act_MiB", "act%"]


def _jobs(steps: int) -> dict[str, list[str]]:
    return {
        f"{model} {precision}": [
            *overrides,
            f"precision={precision}",
            f"trainer.max_steps={steps}",
            "data.train_samples=256",
            "profile.layers=true",
        ]
        for model, overrides in MODELS.items()
        for precision in PRECISIONS
    }


def _top(rows: list[dict], n: int = 10) -> list[dict]:
    top = sorted(rows, key=lambda r: r["time_s"], reverse=True)[:n]
    return [
        {
            "name": r["name"],
            "type": r["type"],
            "bound": r["bound"],
            "intensity": r["intensity"],
            "time_ms": r["time_s"] * 1e3,
            "time%": 100 * r["time_share"],
            "flops%": 100 * r["flops_share"],
            "act_MiB": mib(r["activation_bytes"]),
            "act%": 100 * r["activation_share"],
        }
        for r in top
    ]


def _lines(name: str, r: dict) -> list[str]:
    ratio = r["layers/sum_over_step_time"]
    verdict = "ok" if 0.7 <= ratio <= 1.3 else "MISSED"
    return [
        f"== {name}: ridge {r['layers/ridge_flops_per_byte']:.3g} FLOPs/byte "
        f"({r['layers/peak_flops'] / 1e9:.4g} GFLOP/s / "
        f"{r['layers/bandwidth_bytes_per_s'] / 1e9:.4g} GB/s), {int(r['layers/rows'])} rows",
        table(_top(r["layers/table"]), COLUMNS),
        f"memory-bound layers: {r['layers/memory_bound_flops_frac']:.1%} of FLOPs, "
        f"{r['layers/memory_bound_time_frac']:.1%} of time, "
        f"{r['layers/memory_bound_activation_frac']:.1%} of activations",
        f"sum of per-layer times {r['layers/sum_time_s'] * 1e3:.1f} ms / step time without XLA "
        f"{r['layers/step_time_noxla_s'] * 1e3:.1f} ms = {ratio:.3f} (target 0.7-1.3: "
        f"{verdict}); the run's own step {r['speed/step_time_s_p50'] * 1e3:.1f} ms",
        f"most activation memory: {r['layers/top_activation']}",
        "",
    ]


def main(extra: list[str], steps: int = 3) -> dict[str, dict]:
    results = run_jobs(_jobs(steps), extra)
    for name, r in results.items():
        print("\n".join(_lines(name, r)))
    return results
