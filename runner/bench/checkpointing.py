"""Each checkpointing policy against `none`: steady-state peak and step time, on the CPU.

Targets (issue 5): transformer (6 layers) `blocks` peak <= 0.4 x `none` at step time
<= 1.4 x; MobileNetV2 at 224x224, batch 16, `blocks` peak <= 0.7 x `none`; `sqrt` beside.
"""

from runner.bench import mib, run_jobs, table

MODELS = {
    "transformer": [
        "model=transformer",
        "model.h=256",
        "model.layers=6",
        "model.heads=8",
        "data.seq_len=256",
        "data.batch_size=16",
        "data.vocab_size=256",
    ],
    "mobilenet": [
        "model=mobilenet",
        "model.version=v2",
        "data.image_size=224",
        "data.batch_size=16",
    ],
}
POLICIES = {
    "transformer": ("none", "blocks", "sqrt", "every"),
    "mobilenet": ("none", "blocks", "sqrt"),
}
TARGETS = {("transformer", "blocks"): (0.4, 1.4), ("mobilenet", "blocks"): (0.7, None)}


def _jobs(steps: int) -> dict[str, list[str]]:
    return {
        f"{model} {policy}": [
            *overrides,
            f"checkpointing={policy}",
            f"trainer.max_steps={steps}",
            "data.train_samples=256",
        ]
        for model, overrides in MODELS.items()
        for policy in POLICIES[model]
    }


def _verdict(model: str, policy: str, peak_ratio: float, time_ratio: float) -> str:
    if (model, policy) not in TARGETS:
        return ""
    peak_target, time_target = TARGETS[model, policy]
    ok = peak_ratio <= peak_target and (time_target is None or time_ratio <= time_target)
    wanted = f"peak <= {peak_target}" + (f", time <= {time_target}" if time_target else "")
    return f"target {wanted}: {'ok' if ok else 'MISSED'}"


def main(extra: list[str], steps: int = 5) -> dict[str, dict]:
    results = run_jobs(_jobs(steps), extra)
    rows = []
    for name, r in results.items():
        model, policy = name.split()
        base = results[f"{model} none"]
        peak_ratio = r["mem/peak_bytes"] / base["mem/peak_bytes"]
        time_ratio = r["speed/step_time_s_p50"] / base["speed/step_time_s_p50"]
        rows.append(
            {
                "job": name,
                "segments": int(r.get("remat/segments", 0)),
                "peak_MiB": mib(r["mem/peak_bytes"]),
                "peak/none": peak_ratio,
                "step_s": r["speed/step_time_s_p50"],
                "time/none": time_ratio,
                "hw/model_flops": r["speed/hardware_flops_per_step"] / r["speed/flops_per_step"],
                "measured/estimate": r["mem/measured_over_estimate"],
                "verdict": _verdict(model, policy, peak_ratio, time_ratio),
            }
        )
    print(
        table(
            rows,
            [
                "job",
                "segments",
                "peak_MiB",
                "peak/none",
                "step_s",
                "time/none",
                "hw/model_flops",
                "measured/estimate",
                "verdict",
            ],
        )
    )
    return results
