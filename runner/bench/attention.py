"""`python -m runner.bench attention`: standard against chunked attention in the whole
transformer (issue 29), h=128, 4 layers, 8 heads, batch 4, float32, its default XLA:

    python -m runner.bench attention                  # all four parts below, in this order
    python -m runner.bench attention --only side      # one part (--only again: more)
    python -m runner.bench attention --core [--xla]   # the attention core alone against s

- side: chunked vs standard at 1,024 tokens, 3 runs each: peak <= 0.35x, step <= 1.3x;
- selective: `checkpointing=selective` with chunked vs none with standard at 512 tokens,
  batch 8: peak <= 0.5x, step <= 1.2x (runner/bench/attention_pairs.py);
- sweep: peak and step time against s from 256 to 4096, and attention_scaling.png
  (runner/bench/attention_sweep.py, runner/bench/attention_plot.py);
- budget: each kind's longest sequence under one TF_CPU_BFC_MEM_LIMIT_IN_MB: chunked >= 4x
  standard's (runner/bench/attention_budget.py).

Every job runs in a fresh process and reports the runner's own figures (the steady step peak
and the p50 step time a user's run logs). Timing is interleaved: the two jobs of a comparison
alternate (A B A B ...) and a sweep runs both kinds at each length before the next, so that
the other load on a shared machine falls on both alike; ratios divide figures of this run.
Arguments the parser does not know are Hydra overrides for every job.
"""

import argparse
from pathlib import Path

PARTS = ("side", "selective", "sweep", "budget")


def command_line() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runner.bench attention", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add("--only", action="append", choices=PARTS, help="a part to run (default: all)")
    add("--repeats", type=int, default=3, help="side, selective: runs of each job")
    add("--steps", type=int, default=6, help="side, selective: optimizer steps a job")
    add("--seq", type=int, default=1024, help="side: the sequence length")
    add("--selective-seq", type=int, default=512, help="selective: the sequence length")
    add("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096], help="sweep")
    add("--sweep-steps", type=int, default=3, help="sweep: optimizer steps a job")
    add("--sweep-limit-mib", type=int, default=8192, help="sweep: the allocator's limit")
    add("--max-step-s", type=float, default=60.0, help="sweep: a kind stops after a slower step")
    add("--out", type=Path, default=Path("outputs/bench"), help="sweep: the picture's folder")
    add("--limit-mib", type=int, default=256, help="budget: TF_CPU_BFC_MEM_LIMIT_IN_MB")
    add("--start", type=int, default=512, help="budget: the first length tried")
    add("--ceiling", type=int, default=16384, help="budget: the longest length tried")
    return parser


def _check(args: argparse.Namespace) -> None:
    for key in ("repeats", "steps", "seq", "selective_seq", "limit_mib", "start"):
        if getattr(args, key) < 1:
            flag = "--" + key.replace("_", "-")
            raise SystemExit(f"error: {flag} {getattr(args, key)}: expected an integer >= 1")
    if args.sweep_steps < 2 or args.steps < 2:
        flag = "--steps" if args.steps < 2 else "--sweep-steps"
        raise SystemExit(f"error: {flag}: expected >= 2 (the first step compiles, untimed)")


def main(argv: list[str]) -> dict:
    if argv[:1] == ["--core"]:
        from runner.bench import attention_core

        return attention_core.main(argv[1:])
    from runner.bench import attention_budget, attention_pairs, attention_sweep

    args, extra = command_line().parse_known_args(argv)
    _check(args)
    parts, out = args.only or PARTS, {}
    if "side" in parts:
        pair = attention_pairs.side(args.seq)
        out["side"] = attention_pairs.compare(pair, args.repeats, args.steps, extra)
    if "selective" in parts:
        pair = attention_pairs.selective(args.selective_seq)
        out["selective"] = attention_pairs.compare(pair, args.repeats, args.steps, extra)
    if "sweep" in parts:
        sweep = (args.lengths, args.sweep_limit_mib, args.max_step_s, args.sweep_steps)
        out["sweep"] = attention_sweep.main(*sweep, extra, args.out)
    if "budget" in parts:
        budget = (args.limit_mib, args.start, args.ceiling, extra)
        out["budget"] = attention_budget.main(*budget)
    return out
