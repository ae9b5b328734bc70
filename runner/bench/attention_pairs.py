"""Two whole-model jobs side by side, each run `repeats` times in fresh processes, interleaved
(A B A B ...): the machine's other load falls on both alike. The peak and the p50 step time are
the runner's own (runner/bench/attention_jobs.py); ratios divide the medians of this run.

- chunked against standard attention at 1,024 tokens: peak <= 0.35x at <= 1.3x the time;
- `checkpointing=selective model.attention=chunked` against `checkpointing=none
  model.attention=standard` at 512 tokens (h=128, 4 layers, 8 heads, batch 8, the
  checkpointing benchmark's group where `selective` alone read 0.71x at 1.29x): peak <= 0.5x at
  <= 1.2x the time.
"""

import os
from typing import NamedTuple

from runner.bench import mib, run_jobs, table
from runner.bench.attention_jobs import PEAK, STEP, describe, overrides, spread


class Pair(NamedTuple):
    name: str
    seq: int
    base: tuple[str, list[str]]  # (label, overrides) of the job divided by
    other: tuple[str, list[str]]
    target: tuple[float, float]  # other/base: (peak, step time) at most


def side(seq: int) -> Pair:
    return Pair(
        f"chunked vs standard attention, {seq} tokens",
        seq,
        ("standard", []),
        ("chunked", []),
        (0.35, 1.3),
    )


def selective(seq: int) -> Pair:
    return Pair(
        f"selective + chunked vs none + standard, {seq} tokens, batch 8",
        seq,
        ("none+standard", ["checkpointing=none", "data.batch_size=8"]),
        ("selective+chunked", ["checkpointing=selective", "data.batch_size=8"]),
        (0.5, 1.2),
    )


COLUMNS = ["job", "runs", "peak_MiB", "peak_min-max", "peak/base", "step_s", "step_min-max"]
COLUMNS += ["time/base"]


def _kind(label: str) -> str:
    return "chunked" if "chunked" in label else "standard"


def jobs(pair: Pair, repeats: int, steps: int) -> dict[str, list[str]]:
    """The pair's jobs in the order they run: base, other, base, other, ..."""
    out = {}
    for i in range(1, repeats + 1):
        for label, more in (pair.base, pair.other):
            # The pair's own overrides come after the kind's; the command line's after both.
            job = overrides(_kind(label), pair.seq, [*more, f"trainer.max_steps={steps}"])
            out[f"{label} #{i}"] = [*job, f"data.train_samples={max(64, 8 * steps)}"]
    return out


def verdict(target: tuple[float, float], peak_ratio: float, time_ratio: float) -> str:
    peak_most, time_most = target
    ok = peak_ratio <= peak_most and time_ratio <= time_most
    return (
        f"peak {peak_ratio:.2f}x (target <= {peak_most}), step time {time_ratio:.2f}x "
        f"(target <= {time_most}): {'ok' if ok else 'MISSED'}"
    )


def rows(pair: Pair, results: dict[str, dict]) -> list[dict]:
    """One row per job kind: medians and ranges over its repeats; ratios to the base's medians."""
    out = []
    for label, _ in (pair.base, pair.other):
        runs = [r for name, r in results.items() if name.rsplit(" #", 1)[0] == label]
        peak, peak_lo, peak_hi = spread([mib(r[PEAK]) for r in runs])
        step, step_lo, step_hi = spread([r[STEP] for r in runs])
        out.append(
            {
                "job": label,
                "runs": len(runs),
                "peak_MiB": peak,
                "peak_min-max": f"{peak_lo:.1f}-{peak_hi:.1f}",
                "step_s": step,
                "step_min-max": f"{step_lo:.3f}-{step_hi:.3f}",
            }
        )
    for row in out:
        row["peak/base"] = row["peak_MiB"] / out[0]["peak_MiB"]
        row["time/base"] = row["step_s"] / out[0]["step_s"]
    return out


def compare(pair: Pair, repeats: int, steps: int, extra: list[str]) -> dict:
    """Run the pair interleaved, print its table and verdict; returns both."""
    before = os.getloadavg()[0]
    results = run_jobs(jobs(pair, repeats, steps), extra)
    table_rows = rows(pair, results)
    line = verdict(pair.target, table_rows[1]["peak/base"], table_rows[1]["time/base"])
    print(f"== {pair.name}: {describe([*pair.base[1], *extra])}; {repeats} runs each, interleaved")
    print(
        f"load average (1 min) of the machine: {before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(table(table_rows, COLUMNS))
    print(f"{pair.other[0]} / {pair.base[0]}: {line}")
    return {"rows": table_rows, "verdict": line, "results": results}
