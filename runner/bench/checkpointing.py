"""Each checkpointing policy (and 16-bit attention) against its baseline: steady-state peak and
step time, one process per job, on the CPU.

Groups of jobs, each against its first job (the baseline), with the targets of issues 5 and 15:
- transformer h=256, 6 layers, 256 tokens, batch 16 (XLA): blocks <= 0.4x peak at <= 1.4x
  time; sqrt, every and selective beside;
- transformer h=128, 4 layers, 8 heads, 512 tokens, batch 8 (XLA): selective <= 0.6x peak at
  <= 1.15x time;
- the default 2-layer transformer at batch 16 and 128 tokens, and at 3 and 4 layers, with and
  without XLA:
  blocks <= 0.75x peak (blocks must save at every depth of 2 or more);
- MobileNetV2 224x224, batch 16: blocks <= 0.7x peak; selective <= 0.8x at <= 1.25x time;
- transformer at dropout 0 without XLA (s=256, b=8, h=32, 4 heads, 2 layers): bf16 <= 0.7x
  fp32's peak (16-bit attention keeps 16-bit probabilities);
- with --unseen: keras.applications models and a U-Net, cut by structure (runner/bench/cuts.py):
  blocks on ResNet50 at 64x64, batch 16 <= 0.7x peak.

With `--repeats N` the jobs run in N interleaved rounds; each ratio is then printed with its
bootstrap interval and each verdict taken on the interval's far end (runner/bench/noise.py).
"""

from typing import NamedTuple

from runner.bench import mib, run_rounds, table
from runner.bench.noise import Ratio, medians, note, ratio, take_repeats, verdict


class Group(NamedTuple):
    name: str
    overrides: list[str]
    baseline: str  # the override that makes the baseline job
    variants: dict[str, tuple[float, float | None] | None]  # override -> (peak, time) target


BIG = ["model.h=256", "model.layers=6", "model.heads=8", "data.seq_len=256", "data.batch_size=16"]
LONG = ["model.h=128", "model.layers=4", "model.heads=8", "data.seq_len=512", "data.batch_size=8"]
NARROW = ["model.h=32", "model.heads=4", "model.layers=2", "data.seq_len=256", "data.batch_size=8"]
TRANSFORMER = ["model=transformer", "data.vocab_size=256"]
NO_XLA = "trainer.jit_compile=false"


def _depth_groups() -> list[Group]:
    return [
        Group(
            f"default L{depth} {'XLA' if xla else 'no XLA'}",
            ["model=transformer", f"model.layers={depth}", "data.seq_len=128", "data.batch_size=16"]
            + ([] if xla else [NO_XLA]),
            "checkpointing=none",
            {"checkpointing=blocks": (0.75, None)},
        )
        for xla in (True, False)
        for depth in (2, 3, 4)
    ]


GROUPS = [
    Group(
        "transformer h256 L6",
        [*TRANSFORMER, *BIG],
        "checkpointing=none",
        {
            "checkpointing=blocks": (0.4, 1.4),
            "checkpointing=sqrt": None,
            "checkpointing=every": None,
            "checkpointing=selective": None,
        },
    ),
    Group(
        "transformer h128 L4 s512",
        [*TRANSFORMER, *LONG],
        "checkpointing=none",
        {"checkpointing=selective": (0.6, 1.15)},
    ),
    *_depth_groups(),
    Group(
        "mobilenet v2 224",
        ["model=mobilenet", "model.version=v2", "data.image_size=224", "data.batch_size=16"],
        "checkpointing=none",
        {
            "checkpointing=blocks": (0.7, None),
            "checkpointing=sqrt": None,
            "checkpointing=selective": (0.8, 1.25),
        },
    ),
    Group(
        "transformer dropout 0 no XLA",
        [*TRANSFORMER, *NARROW, "model.dropout=0", NO_XLA],
        "precision=fp32",
        {"precision=bf16": (0.7, None)},
    ),
]


def _jobs(groups: list[Group], steps: int) -> dict[str, list[str]]:
    common = [f"trainer.max_steps={steps}", "data.train_samples=256"]
    return {
        f"{group.name} | {choice}": [*group.overrides, choice, *common]
        for group in groups
        for choice in (group.baseline, *group.variants)
    }


def _verdict(target, peak: Ratio, time: Ratio) -> str:
    """The target's verdict, taken on each ratio's far end (runner/bench/noise.py)."""
    if target is None:
        return ""
    peak_target, time_target = target
    checks = [(peak, peak_target)] + ([(time, time_target)] if time_target else [])
    wanted = f"peak <= {peak_target}" + (f", time <= {time_target}" if time_target else "")
    return f"target {wanted}: {verdict(checks)}"


def _rows(groups: list[Group], results: dict[str, list[dict]]) -> list[dict]:
    """One row per job: its medians over the repeats, its ratios to the group's baseline."""
    rows = []
    for group in groups:
        base = results[f"{group.name} | {group.baseline}"]
        for choice in (group.baseline, *group.variants):
            runs = results[f"{group.name} | {choice}"]
            peak, time = (ratio(runs, base, k) for k in ("mem/peak_bytes", "speed/step_time_s_p50"))
            is_base = choice == group.baseline  # its ratios are 1 by definition
            r = medians(runs)
            rows.append(
                {
                    "group": group.name,
                    "job": choice.split("=")[1],
                    "segments": int(r.get("remat/segments", 0)),
                    "peak_MiB": mib(r["mem/peak_bytes"]),
                    "peak/base": "1" if is_base else str(peak),
                    "step_s": r["speed/step_time_s_p50"],
                    "time/base": "1" if is_base else str(time),
                    "hw/model_flops": r["speed/hardware_flops_per_step"]
                    / r["speed/flops_per_step"],
                    "measured/estimate": r["mem/measured_over_estimate"],
                    "verdict": _verdict(group.variants.get(choice), peak, time),
                }
            )
    return rows


COLUMNS = [
    "group",
    "job",
    "segments",
    "peak_MiB",
    "peak/base",
    "step_s",
    "time/base",
    "hw/model_flops",
    "measured/estimate",
    "verdict",
]


def _only(extra: list[str]) -> tuple[list[Group], list[str]]:
    """(the groups `--only NAME` picks, by a part of their name, or all; the other args)."""
    picked, rest, args = [], [], iter(extra)
    for arg in args:
        if arg == "--only":
            part = next(args, None)
            if part is None or not any(part in g.name for g in GROUPS):
                names = ", ".join(g.name for g in GROUPS)
                raise SystemExit(f"error: --only {part}: no such group; expected part of: {names}")
            picked += [g for g in GROUPS if part in g.name and g not in picked]
        else:
            rest.append(arg)
    return picked or GROUPS, rest


def main(extra: list[str], steps: int = 5) -> dict[str, list[dict]] | list[dict]:
    """`python -m runner.bench checkpointing [--only NAME ...] [--repeats N] [overrides...]`, or
    `... checkpointing --unseen [MODEL ...]`: models without block names (runner/bench/cuts.py).
    Returns each job's repeats' results, in round order."""
    if extra[:1] == ["--unseen"]:
        from runner.bench import cuts

        return cuts.main(extra[1:])
    repeats, extra = take_repeats(extra)
    groups, extra = _only(extra)
    results = run_rounds(_jobs(groups, steps), extra, repeats)
    print(table(_rows(groups, results), COLUMNS))
    print(note(repeats))
    return results
