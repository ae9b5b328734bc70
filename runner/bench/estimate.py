"""The estimate against the measured peak over the transformer's calibration matrix: every
precision x dropout x checkpointing policy (issue 15's band, 0.85-1.15), one process per job.

    python -m runner.bench estimate [overrides...]
    python -m runner.bench estimate --unseen [overrides...]   # models it was never written for
    python -m runner.bench estimate --draws N [--seed S] [overrides...]  # jobs drawn at random

The suite runs four of these cells (EACH_VALUE: every value of each factor at least once;
pairs of values are left to the randomized draws, tests/test_estimate_draws.py); this
benchmark runs all of them.
"""

import itertools
import random
import time

from runner.bench import draws, draws_user, mib, run_jobs, table

# At these sizes the attention core dominates, so the rules for it are what is checked.
SIZES = [
    "model=transformer",
    "model.h=32",
    "model.heads=4",
    "model.layers=2",
    "data.seq_len=256",
    "data.batch_size=8",
    "data.vocab_size=256",
    "data.train_samples=48",
    "data.val_samples=8",
    "trainer.max_steps=3",
    "trainer.jit_compile=false",
]
PRECISIONS = ("fp32", "bf16", "mixed")
DROPOUTS = ("0", "0.1")
POLICIES = ("none", "blocks", "selective")
CELLS = list(itertools.product(PRECISIONS, DROPOUTS, POLICIES))
# Four of the 18 cells that hold every value of each factor, with the one CI once read at
# the band's edge (mixed/0.1/selective at 1.163); nine held every pair of values, at about
# 16 s of the suite's CPU a cell.
EACH_VALUE = [
    ("fp32", "0", "none"),
    ("bf16", "0.1", "selective"),
    ("mixed", "0.1", "blocks"),
    ("mixed", "0.1", "selective"),
]
BAND = (0.85, 1.15)


def job(cell: tuple[str, str, str]) -> list[str]:
    precision, dropout, policy = cell
    return [*SIZES, f"precision={precision}", f"model.dropout={dropout}", f"checkpointing={policy}"]


def main(extra: list[str], cells: list[tuple] = CELLS) -> dict[tuple, float]:
    """measured / estimate per cell, printed with the band's verdict; `--unseen` first: the
    functional models it was never written for (runner/bench/unseen.py)."""
    if extra[:1] == ["--unseen"]:
        from runner.bench import unseen

        return unseen.main(extra[1:])
    if extra[:1] == ["--draws"]:
        n, seed, rest = draw_args(extra)
        return drawn(draws.draws(n, seed), seed, rest)
    results = run_jobs({" ".join(cell): job(cell) for cell in cells}, extra)
    measured = zip(cells, results.values(), strict=True)
    ratios = {cell: r["mem/measured_over_estimate"] for cell, r in measured}
    rows = [
        {"precision": p, "dropout": d, "checkpointing": c, "measured/estimate": v}
        for (p, d, c), v in ratios.items()
    ]
    print(table(rows, ["precision", "dropout", "checkpointing", "measured/estimate"]))
    low, high = BAND
    outside = [cell for cell, v in ratios.items() if not low <= v <= high]
    print(
        f"measured/estimate {min(ratios.values()):.3f}-{max(ratios.values()):.3f} over "
        f"{len(ratios)} cells (target: every cell in {low}-{high}): "
        + ("ok" if not outside else f"MISSED in {len(outside)}: {outside}")
    )
    return ratios


def draw_args(extra: list[str]) -> tuple[int, int, list[str]]:
    """(N, seed, the other overrides) of `--draws N [--seed S] ...`; no seed: one at random."""
    usage = "usage: python -m runner.bench estimate --draws N [--seed S] [overrides...]"
    try:
        n, rest = int(extra[1]), extra[2:]
        seed = random.SystemRandom().randrange(10**6)
        if rest[:1] == ["--seed"]:
            seed, rest = int(rest[1]), rest[2:]
    except (IndexError, ValueError):
        raise SystemExit(usage) from None
    if n < 1:
        raise SystemExit(f"--draws {n}: expected a number of draws >= 1")
    return n, seed, rest


def run_draw(knobs: dict, extra: list[str]) -> dict:
    """One draw's run(cfg) in a fresh process: its logged figures, or {"error": why}."""
    # a user's model (runner/bench/draws_user.py) is composed from examples/conf
    config_dir = draws_user.examples_importable() if draws_user.is_user(knobs) else None
    try:
        job = {draws.describe(knobs): draws.overrides(knobs)}
        return run_jobs(job, extra, config_dir).popitem()[1]
    except Exception as error:  # a draw that fails is reported, not a crash of the sweep
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}


def drawn(
    jobs: list[dict], seed: int, extra: list[str], budget: draws.Budget = draws.BUDGET
) -> list[dict]:
    """Each drawn job run and printed as it ends, then the table and the distribution."""
    print(
        f"seed {seed}: {len(jobs)} draws within {budget.gflops} GFLOP an optimizer step and "
        f"{budget.mib:.0f} MiB held (roughly)",
        flush=True,
    )
    rows = []
    for i, knobs in enumerate(jobs):
        start = time.monotonic()
        result = run_draw(knobs, extra)
        ratio, said = draws.verdict(result, BAND)
        rows.append(
            {"draw": i, "job": draws.describe(knobs),
             "peak_MiB": mib(result["mem/peak_bytes"]) if "mem/peak_bytes" in result else None,
             "estimate_MiB": mib(result["mem/estimate_bytes"]) if ratio else None,
             "measured/estimate": ratio, "verdict": said,
             "seconds": round(time.monotonic() - start)}
        )  # fmt: skip
        print(" | ".join(str(v) for v in rows[-1].values()), flush=True)
    print(table(rows, list(rows[0])))
    ratios = [r["measured/estimate"] for r in rows if r["measured/estimate"] is not None]
    bounded = sum(r["verdict"] == "ok (in its bound)" for r in rows)
    print(f"seed {seed}: " + draws.distribution(ratios, BAND))
    if bounded:
        print(f"seed {seed}: {bounded} more draw(s) outside the band within their estimate's bound")
    return rows
