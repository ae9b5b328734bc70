"""`python -m runner.plan [--config-dir DIR] [run.py overrides]`: the cheapest way to fit the
memory budget, as a table (runner/plan/table.py); with plan.measure=true, each row that fits is
probed. `--config-dir` adds a user's config folder (their model YAML) as run.py's does."""

import sys

from hydra._internal.utils import get_args_parser

from runner.cli import check_command_line
from runner.config import compose_config
from runner.core.errors import PlanError
from runner.core.machine import cache_dir
from runner.core.start import import_tensorflow
from runner.core.units import mib


def main(argv: list[str]) -> list:
    check_command_line(argv)  # one line for bad input, before TensorFlow loads
    args = get_args_parser().parse_args(argv)  # run.py's flags (--config-dir) apart
    cfg = compose_config(args.overrides, args.config_dir)
    import_tensorflow()
    from runner.estimate.xla_plan import Ledger
    from runner.plan import probe, table

    try:
        ledger = Ledger()  # each XLA plan read: (seconds, from the cache)
        rows, total, source, usable = table.table(cfg, ledger=ledger)
    except PlanError as err:
        raise SystemExit(f"error: {err}") from None
    effective = table.target_batch(cfg)
    fitting = [r for r in rows if r.fits]
    if fitting:
        best = fitting[0]
        print(
            f"cheapest that fits: {best.command()} (predicted peak {best.predicted_MiB:.1f} "
            f"MiB of {mib(total):.1f}, time {best.time_ratio:.2f}x fp32/none)"
        )
    else:
        print(f"nothing fits in {mib(total):.1f} MiB at effective batch {effective}")
    print(
        f"model={cfg.model.name}, effective batch {effective} (trainer.effective_batch_size), "
        f"budget {mib(total):.1f} MiB ({source}), {mib(usable):.1f} MiB usable after "
        f"plan.margin={cfg.plan.margin}; predicted peaks are "
        + (
            "XLA's own plans of the step (trainer.jit_compile)"
            if ledger.reads
            else "the analytic estimate"
        )
    )
    if ledger.reads:  # runner/estimate/xla_plan.py: compiled, or read from the cache
        cached = sum(hit for _, hit in ledger.reads)
        at_once = f" by {ledger.processes} processes at once" if ledger.processes > 1 else ""
        print(
            f"XLA's plans: {len(ledger.reads)} read in {ledger.seconds:.1f} s{at_once}, "
            f"{cached} from the cache ({cache_dir()})"
        )
    if cfg.plan.measure:
        for row in fitting:
            result = probe.probe(
                table.job(cfg, row.precision, row.checkpointing, row.attention),
                row.micro_batch,
                row.accum,
            )
            row.measured_MiB = None if result["oom"] else mib(result["peak_bytes"])
            row.note = "out of memory" if result["oom"] else ""
    print(table.text(rows, cfg.plan.measure))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
