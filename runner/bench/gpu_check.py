"""On a GPU machine: the transformer under fp32, mixed and bf16, side by side."""

from runner.bench import run_jobs, table


def main(extra: list[str]) -> dict[str, dict]:
    """Transformer fp32 vs mixed (float16) on a GPU, side by side."""
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        raise SystemExit("error: gpu_check needs a GPU; this machine has none")
    size = [
        "model.h=1024",
        "model.layers=8",
        "model.heads=16",
        "data.seq_len=512",
        "data.batch_size=16",
        "data.vocab_size=1024",
        "trainer.max_steps=30",
        "trainer.device=gpu",
    ]
    jobs = {p: [f"precision={p}", *size] for p in ("fp32", "mixed", "bf16")}
    results = run_jobs(jobs, extra)
    keys = [
        "mem/peak_bytes",
        "mem/estimate_bytes",
        "mem/measured_over_estimate",
        "speed/step_time_s_p50",
        "speed/tokens_per_s",
        "speed/mfu",
    ]
    print(
        table(
            [{"precision": p, **{k: r[k] for k in keys}} for p, r in results.items()],
            ["precision", *keys],
        )
    )
    base = results["fp32"]
    for p in ("mixed", "bf16"):
        print(
            f"{p} / fp32: peak {results[p]['mem/peak_bytes'] / base['mem/peak_bytes']:.2f} "
            f"(target <= 0.75), step time "
            f"{results[p]['speed/step_time_s_p50'] / base['speed/step_time_s_p50']:.2f}"
        )
    return results
