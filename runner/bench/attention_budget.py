"""The longest sequence each attention kind trains under one fixed CPU allocator limit
(TF_CPU_BFC_MEM_LIMIT_IN_MB): lengths doubled from `start` until one does not fit, then
bisected between the last that fit and the first that did not, on multiples of the chunked
core's block. Each length is a probe (runner/plan/probe.py: two optimizer steps in a fresh
process that inherits the limit; an out-of-memory error there is "does not fit").

The model is the side-by-side one (h=128, 8 heads) at 2 layers and batch 1: both kinds' memory
grows per layer and per example alike, so these leave the lengths' ratio nearly as it is (the
fixed parts, weights and logits, weigh a little more), while a probe of chunked attention at
4,096 tokens has 8x fewer attention FLOPs (they grow as layers x batch x s^2).
"""

from collections.abc import Callable

from runner.bench import mib, table
from runner.bench.attention_jobs import KINDS, block_size, compose, cpu_limit, describe
from runner.plan.probe import probe

TARGET = 4.0  # chunked's longest / standard's, at least
MODEL = ["model.layers=2", "data.batch_size=1"]  # before the command line's overrides
STEPS = 2  # the first step and one more: a later step's peak can exceed the first's
COLUMNS = ["attention", "s", "fits", "peak_MiB"]


def longest(fits: Callable[[int], bool], start: int, block: int, ceiling: int) -> int:
    """The longest multiple of `block` that fits (0: not even one block), given that what fits
    shrinks as s grows: doubling from `start`, then a bisection; `ceiling` the longest tried."""
    good, bad, s = 0, None, start
    while s <= ceiling:
        if not fits(s):
            bad = s
            break
        good, s = s, 2 * s
    if bad is None:
        return good
    while bad - good > block:
        middle = (good + bad) // 2 // block * block
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def search(kind: str, start: int, block: int, ceiling: int, extra: list[str]) -> tuple[int, list]:
    """(kind's longest s, the probes that found it) under the limit already set."""
    seen = []

    def fits(seq: int) -> bool:
        cfg = compose(kind, seq, [*MODEL, *extra])
        got = probe(cfg, cfg.data.batch_size, 1, steps=STEPS)
        peak = None if got["oom"] else mib(got["peak_bytes"])
        seen.append({"attention": kind, "s": seq, "fits": not got["oom"], "peak_MiB": peak})
        return not got["oom"]

    return longest(fits, start, block, ceiling), seen


def verdict(lengths: dict[str, int], ceiling: int) -> str:
    std, chk = lengths["standard"], lengths["chunked"]
    ratio = chk / std if std else float("inf")
    at_ceiling = " (chunked at the ceiling: it may go further)" if chk >= ceiling else ""
    ok = ratio >= TARGET
    return (
        f"longest: standard {std}, chunked {chk} tokens{at_ceiling}: {ratio:.2f}x "
        f"(target >= {TARGET:g}): {'ok' if ok else 'MISSED'}"
    )


def main(limit_mib: int, start: int, ceiling: int, extra: list[str]) -> dict:
    block = block_size(extra)
    if start % block:
        raise SystemExit(f"error: --start {start}: expected a multiple of the block, {block}")
    lengths, probes = {}, []
    with cpu_limit(limit_mib):
        for kind in KINDS:
            lengths[kind], seen = search(kind, start, block, ceiling, extra)
            probes += seen
    line = verdict(lengths, ceiling)
    print(
        f"== longest sequence under TF_CPU_BFC_MEM_LIMIT_IN_MB={limit_mib}: "
        f"{describe([*MODEL, *extra])}; "
        f"doubling from {start}, then bisection to a multiple of {block}"
    )
    print(table(probes, COLUMNS))
    print(line)
    return {"lengths": lengths, "probes": probes, "verdict": line}
