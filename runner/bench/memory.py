"""Transformer peak memory vs batch size and width, measured beside the analytic estimate."""

from runner.bench import run_jobs, table

MEMORY_JOBS = {
    f"{p} b={b} h={h}": [
        f"precision={p}",
        f"data.batch_size={b}",
        f"model.h={h}",
        "model.layers=4",
        "data.seq_len=128",
        "trainer.max_steps=8",
    ]
    for p in ("fp32", "bf16")
    for b, h in ((8, 128), (32, 128), (8, 256))
}


def main(extra: list[str]) -> dict[str, dict]:
    """Peak vs batch size and width (transformer), and measured / estimate, per precision."""
    results = run_jobs(MEMORY_JOBS, extra)
    rows = [
        {
            "job": name,
            "peak_MiB": r["mem/peak_bytes"] / 2**20,
            "estimate_MiB": r["mem/estimate_bytes"] / 2**20,
            "measured/estimate": r["mem/measured_over_estimate"],
            "step_s": r["speed/step_time_s_p50"],
        }
        for name, r in results.items()
    ]
    print(table(rows, ["job", "peak_MiB", "estimate_MiB", "measured/estimate", "step_s"]))
    for p in ("fp32", "bf16"):
        peak = {
            k: results[f"{p} {k}"]["mem/peak_bytes"]
            for k in ("b=8 h=128", "b=32 h=128", "b=8 h=256")
        }
        print(
            f"{p}: peak(batch 32) / peak(batch 8) = {peak['b=32 h=128'] / peak['b=8 h=128']:.2f}"
            f" (target > 2); peak(h=256) / peak(h=128) = "
            f"{peak['b=8 h=256'] / peak['b=8 h=128']:.2f} (target > 1)"
        )
    return results
