"""On a GPU machine: the transformer under fp32, mixed and bf16, side by side.

Target (issue 4): mixed and bf16 peak <= 0.75 x the fp32 peak at equal batch. The whole
check should finish in under 5 minutes on one GPU (issue 3); it prints its wall time.
"""

import time

from runner.bench import run_jobs, table

# Large enough that activations, which 16-bit policies halve, outweigh the float32 weights
# and optimizer slots that every policy keeps.
SIZE = [
    "model.h=1024",
    "model.layers=8",
    "model.heads=16",
    "data.seq_len=512",
    "data.batch_size=16",
    "data.vocab_size=1024",
    "trainer.max_steps=30",
]
TARGET = 0.75
KEYS = [
    "mem/peak_bytes",
    "mem/estimate_bytes",
    "mem/measured_over_estimate",
    "speed/compile_s",
    "speed/step_time_s_p50",
    "speed/tokens_per_s",
    "speed/mfu",
]


def main(extra: list[str]) -> dict[str, dict]:
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        raise SystemExit("error: gpu_check needs a GPU; this machine has none")
    return compare([*SIZE, "trainer.device=gpu", *extra])


def compare(overrides: list[str]) -> dict[str, dict]:
    """Train the same job under each precision (a fresh process each) and print the figures
    and each 16-bit policy's peak and step time over fp32's."""
    started = time.perf_counter()
    results = run_jobs({p: [f"precision={p}"] for p in ("fp32", "mixed", "bf16")}, overrides)
    rows = [{"precision": p, **{k: r.get(k) for k in KEYS}} for p, r in results.items()]
    print(table(rows, ["precision", *KEYS]))
    base = results["fp32"]
    for p in ("mixed", "bf16"):
        peak = results[p]["mem/peak_bytes"] / base["mem/peak_bytes"]
        step = results[p]["speed/step_time_s_p50"] / base["speed/step_time_s_p50"]
        verdict = "ok" if peak <= TARGET else "MISSED"
        print(
            f"{p:5s} / fp32: peak {peak:.2f} (target <= {TARGET}), step time {step:.2f}   {verdict}"
        )
    print(f"gpu_check: {len(results)} jobs in {time.perf_counter() - started:.0f} s")
    return results
