"""What removing channels buys against zeroing weights (issue 51): MobileNetV2 (alpha 1.0,
digits at 96 px) and the transformer at h=256, 4 layers, 256 tokens, each trained dense, 50%
unstructured (pruning=polynomial) and 50% structured (pruning=structured: channels masked on
the ramp, removed at half the run, the rest fine-tuning the smaller model).

    python -m runner.bench structured [--repeats N] [--rounds R] [--steps S] [overrides...]

Training: each job's step time and step peak are its run's (a structured run's are those of
the steps after the removal: the smaller model's), N interleaved repeats (2 by default), each
ratio with its interval paired by round (runner/bench/noise.py). Deployment: each job's float32
LiteRT file (deploy=litert) timed side by side at batch 1, R rounds (5), as `runner.bench
deploy` times them. Validation accuracy after the fine-tuning, and meas/est of each run.

Targets: structured MobileNetV2 step time <= 0.6x dense, step peak <= 0.7x, float32 LiteRT
batch-1 latency <= 0.6x; the structured transformer (half its heads and MLP units) step time
<= 0.75x, peak <= 0.8x; on digits, structured accuracy within 2 points of dense. Unstructured
is printed beside them as measured.
"""

from pathlib import Path

from mlflow.tracking import MlflowClient

from runner.bench import bench_folder, mib, run_rounds, table
from runner.bench.deploy import files_of, latency, shown, time_side_by_side, zeros_input
from runner.bench.noise import (
    medians,
    note,
    ratio,
    take_repeats,
    take_rounds,
    take_steps,
    verdict,
)

H, LAYERS = 256, 4
MODELS = {
    "mobilenet": (
        ["model=mobilenet", "model.version=v2", "data=digits", "data.image_size=96"],
        300,
    ),
    "transformer": (
        [
            "model=transformer", f"model.h={H}", f"model.layers={LAYERS}", "model.heads=4",
            "data.seq_len=256",
        ],
        120,
    ),
}  # fmt: skip
# (job, target on step time, target on step peak, target on LiteRT batch-1 latency)
TARGETS = {"mobilenet": (0.6, 0.7, 0.6), "transformer": (0.75, 0.8, None)}


def _prunings(steps: int) -> dict[str, list[str]]:
    """Dense; 50% by magnitude, its masks settled at 2/3 of the run; 50% of the channels,
    removed at half of it (the other half fine-tunes the smaller model)."""
    every = f"pruning.frequency={max(steps // 15, 2)}"
    return {
        "dense": ["pruning=none"],
        "unstructured": ["pruning=polynomial", f"pruning.end_step={2 * steps // 3}", every],
        "structured": ["pruning=structured", f"pruning.end_step={steps // 2}", every],
    }


def _jobs(steps: int | None) -> dict[str, list[str]]:
    common = ["deploy=litert", "deploy.rounds=1", "deploy.variants=[float32]"]
    common += ["trainer.save_model=true", "trainer.bn_recalibrate=10"]
    return {
        f"{model} {name}": [*overrides, f"trainer.max_steps={steps or own}", *pruning, *common]
        for model, (overrides, own) in MODELS.items()
        for name, pruning in _prunings(steps or own).items()
    }


def _rows(model: str, runs: dict, timed: dict) -> list[dict]:
    dense = runs[f"{model} dense"]
    rows = []
    for name in ("dense", "unstructured", "structured"):
        job = runs[f"{model} {name}"]
        m = medians(job)
        b1 = latency(timed, (f"{model} {name}", "float32"), (f"{model} dense", "float32"),
                     "latency_b1_p50_ms")  # fmt: skip
        rows.append({
            "job": name,
            "params": int(m["params/total"]),
            "step_ms": 1e3 * m["speed/step_time_s_p50"],
            "step/dense": str(ratio(job, dense, "speed/step_time_s_p50")),
            "peak_MiB": mib(m["mem/peak_bytes"]),
            "peak/dense": str(ratio(job, dense, "mem/peak_bytes")),
            "meas/est": m["mem/peak_bytes"] / m["mem/estimate_bytes"]
            if "mem/estimate_bytes" in m else None,
            "litert_b1/dense": shown(b1),
            "val_acc": m["val/accuracy"],
            "fine_tune_steps": int(m.get("prune/fine_tune_steps", 0)) or "-",
        })  # fmt: skip
    return rows


def _per_layer(runs: dict) -> list[str]:
    """The structured transformer's params and FLOPs against 12h^2 + 13h per layer."""
    m = medians(runs["transformer structured"])
    full = 12 * H * H + 13 * H
    gone = (m["prune/params_before"] - m["prune/params_after"]) / LAYERS
    return [
        f"transformer per layer: {full:,} params at full width (12h^2 + 13h, h={H}); "
        f"structured removed {gone:,.0f} of them ({gone / full:.1%}; half the heads and MLP "
        f"units: 6h^2 + 3.5h = {6 * H * H + 3.5 * H:,.0f})",
        f"transformer params {m['prune/params_ratio']:.3f}x, forward FLOPs "
        f"{m['prune/flops_ratio']:.3f}x (TensorFlow's profiler on one example)",
        f"mobilenet params {medians(runs['mobilenet structured'])['prune/params_ratio']:.3f}x, "
        f"FLOPs {medians(runs['mobilenet structured'])['prune/flops_ratio']:.3f}x",
    ]


def _targets(runs: dict, timed: dict) -> list[str]:
    lines = []
    for model, (step_t, peak_t, lite_t) in TARGETS.items():
        job, dense = runs[f"{model} structured"], runs[f"{model} dense"]
        step, peak = (ratio(job, dense, k) for k in ("speed/step_time_s_p50", "mem/peak_bytes"))
        lines.append(f"{verdict([(step, step_t)])}: {model} structured step time {step} dense "
                     f"(<= {step_t})")  # fmt: skip
        lines.append(f"{verdict([(peak, peak_t)])}: {model} structured step peak {peak} dense "
                     f"(<= {peak_t})")  # fmt: skip
        if lite_t is not None:
            b1 = latency(timed, (f"{model} structured", "float32"), (f"{model} dense", "float32"),
                         "latency_b1_p50_ms")  # fmt: skip
            if b1 is None:
                lines.append(f"MISSED: {model} float32 LiteRT latency was not measured")
            else:
                lines.append(f"{verdict([(b1, lite_t)])}: {model} structured float32 "
                             f"LiteRT batch-1 latency {shown(b1)} dense (<= {lite_t})")  # fmt: skip
    acc = {n: medians(runs[f"mobilenet {n}"])["val/accuracy"] for n in ("dense", "structured")}
    drop = acc["dense"] - acc["structured"]
    ok = "ok" if drop <= 0.02 else "MISSED"
    lines.append(f"{ok}: mobilenet structured val accuracy {acc['structured']:.4f} vs dense "
                 f"{acc['dense']:.4f} (within 2 points)")  # fmt: skip
    return lines


def main(extra: list[str]) -> dict:
    """`python -m runner.bench structured [--repeats N] [--rounds R] [--steps S] [...]`."""
    repeats, extra = take_repeats(extra, 2)
    n, extra = take_rounds(extra, 5)
    steps, extra = take_steps(extra, 0)
    with bench_folder() as (tmp, store):
        runs = run_rounds(_jobs(steps or None), [f"mlflow.tracking_uri={store}", *extra],
                          repeats)  # fmt: skip
        client = MlflowClient(store)
        files = {}
        for name, results in runs.items():  # the first repeat's file of each job
            run_dir = Path(client.get_run(results[0]["run_id"]).data.tags["run_dir"])
            files[(name, "float32")] = files_of(run_dir)["float32"]
        inputs = {}
        for model in MODELS:
            dense = files[(f"{model} dense", "float32")]
            inputs[model] = zeros_input(dense, 1, tmp / f"{model}.npy")
        print(f"\ntiming {len(files)} float32 LiteRT files side by side, {n} rounds")
        timed = time_side_by_side(files, inputs, n, batch_size=1)  # batch 1 alone
    for model in MODELS:
        print(f"\n{model}: training after the removal (structured) against dense; float32 "
              f"LiteRT batch-1 latency over {n} rounds")  # fmt: skip
        rows = _rows(model, runs, timed)
        print(table(rows, list(rows[0])))
    print("\n" + "\n".join(_per_layer(runs)))
    print(note(repeats))
    print("\nTargets:")
    print("\n".join(_targets(runs, timed)))
    return runs
