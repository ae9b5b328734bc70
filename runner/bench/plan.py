"""The planner's accuracy: its predicted peak against the peak measured by a probe.

    python -m runner.bench plan [overrides...]
    python -m runner.bench plan --time [--repeats N] [--steps S] [overrides...]   # its time column

8 configurations, each at two micro-batch sizes (accum 1): the transformer (h=128, 4 layers,
128 tokens) and MobileNetV2 (96x96), fp32 and bf16, checkpointing none and blocks. The
prediction is what `python -m runner.plan` shows (runner/plan/line.py: the analytic estimate,
fixed + b x per_sample); the measurement is what `accum=auto` trusts (a probe: 3 optimizer
steps in a fresh process, the allocator's peak after the first step).

Target (issue 17): every prediction within 15% of its measurement, the median within 7%.
"""

import statistics

from runner.bench import plan_time
from runner.bench.noise import take_repeats, take_steps
from runner.config import compose_config
from runner.core.text import table
from runner.core.units import mib
from runner.plan.line import data_spec, device_info, estimate_line
from runner.plan.probe import probe

MODELS = {
    "transformer": ["model=transformer", "model.h=128", "model.layers=4", "data.seq_len=128"],
    "mobilenet": ["model=mobilenet", "model.version=v2", "data.image_size=96"],
}
PRECISIONS = ("fp32", "bf16")
POLICIES = ("none", "blocks")
BATCHES = (8, 32)


def time_args(args: list[str]) -> tuple[list[str], int, int]:
    """(overrides, repeats, steps) of `plan --time [--repeats N] [--steps S] [overrides...]`."""
    repeats, rest = take_repeats(args, default=3)
    steps, rest = take_steps(rest, default=6)
    return rest, repeats, steps


def main(extra: list[str]) -> list[dict] | dict:
    """The peak check; with --time first, the time check (runner/bench/plan_time.py)."""
    if extra[:1] == ["--time"]:
        return plan_time.main(*time_args(extra[1:]))
    on_gpu, name = device_info()
    rows = []
    for model, overrides in MODELS.items():
        for precision in PRECISIONS:
            for policy in POLICIES:
                cfg = compose_config(
                    [*overrides, f"precision={precision}", f"checkpointing={policy}", *extra]
                )
                spec = data_spec(cfg)
                line, _ = estimate_line(cfg, spec, on_gpu, name)
                for b in BATCHES:
                    measured = probe(cfg, b, 1)
                    predicted = line.peak(b, 1)
                    peak = measured["peak_bytes"]
                    rows.append(
                        {
                            "model": model,
                            "precision": precision,
                            "checkpointing": policy,
                            "micro_batch": b,
                            "predicted_MiB": mib(predicted),
                            "measured_MiB": None if peak is None else mib(peak),
                            "predicted/measured": None if peak is None else predicted / peak,
                        }
                    )
                    print(table(rows[-1:], list(rows[-1])), flush=True)
    columns = list(rows[0])
    print(f"\nPredicted against measured peak on {name} (one probe process per job):")
    print(table(rows, columns))
    errors = [abs(r["predicted/measured"] - 1) for r in rows if r["predicted/measured"]]
    worst, median = max(errors), statistics.median(errors)
    ok = worst <= 0.15 and median <= 0.07 and len(errors) == len(rows)
    print(
        f"\n|predicted/measured - 1|: worst {worst:.1%}, median {median:.1%} over "
        f"{len(errors)} of {len(rows)} jobs (target: every one <= 15%, median <= 7%): "
        f"{'ok' if ok else 'MISSED'}"
    )
    return rows
