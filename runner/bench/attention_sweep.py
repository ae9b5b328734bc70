"""The whole model against the sequence length, standard and chunked attention: the runner's
peak and p50 step time at each length, each job a probe in a fresh process
(runner/plan/probe.py) under a CPU allocator limit, so that a length that does not fit ends
in an out-of-memory error rather than in the machine's swap. At each length the two kinds run
one after the other (interleaved), and a kind stops at its first length that does not fit or
whose step takes longer than `max_step_s`; the picture is runner/bench/attention_plot.py's.
"""

from pathlib import Path

from runner.bench import mib, table
from runner.bench.attention_jobs import KINDS, compose, cpu_limit, describe
from runner.bench.attention_plot import scaling
from runner.plan.probe import probe

COLUMNS = ["s", "attention", "peak_MiB", "step_s", "peak/standard", "time/standard", "note"]


def sweep(
    lengths: list[int], limit_mib: int, max_step_s: float, steps: int, extra: list[str]
) -> list[dict]:
    """One row per (length, kind) run or skipped; a kind's row says why it stopped."""
    rows, stopped = [], {}
    with cpu_limit(limit_mib):
        for seq in lengths:
            here = {}
            for kind in KINDS:
                if kind in stopped:
                    continue
                cfg = compose(kind, seq, extra)
                got = probe(cfg, cfg.data.batch_size, 1, steps=steps)
                row = {"s": seq, "attention": kind, "note": ""}
                if got["oom"]:
                    row["note"] = stopped[kind] = f"does not fit in {limit_mib} MiB"
                else:
                    row.update(peak_MiB=mib(got["peak_bytes"]), step_s=got["step_s"])
                    if got["step_s"] > max_step_s:
                        row["note"] = stopped[kind] = f"step over {max_step_s:g} s: stops here"
                    here[kind] = row
                rows.append(row)
            if len(here) == len(KINDS):
                std, chk = here["standard"], here["chunked"]
                chk["peak/standard"] = chk["peak_MiB"] / std["peak_MiB"]
                chk["time/standard"] = chk["step_s"] / std["step_s"]
    return rows


def main(
    lengths: list[int], limit_mib: int, max_step_s: float, steps: int, extra: list[str], out: Path
) -> list[dict]:
    rows = sweep(lengths, limit_mib, max_step_s, steps, extra)
    print(
        f"== against s: {describe(extra)}; one run each, {steps} steps (p50 of the last "
        f"{steps - 1}), TF_CPU_BFC_MEM_LIMIT_IN_MB={limit_mib}"
    )
    print(table(rows, COLUMNS))
    out.mkdir(parents=True, exist_ok=True)
    print(f"picture: {scaling(rows, describe(extra), out / 'attention_scaling.png')}")
    return rows
