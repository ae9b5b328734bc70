"""One row of `python -m runner.plan`'s table: a job's largest micro-batch predicted to fit the
budget at the target batch, its peak and step time; and the rows of many jobs, computed in
several processes at once where XLA's plans of them must be compiled.

Compiling XLA's plan of a step takes seconds (the default transformer's, at a micro-batch:
2.0-3.2 s on a 2-core CPU, and as long again to trace the step), two plans a row, and one
compile keeps one core busy. A table whose plans are not in the cache is computed in as many
fresh processes as the CPU has cores. Those processes compile with LLVM's code generation at
-O0 (XLA_FLAGS=--xla_backend_optimization_level=0): the option sets LLVM's codegen level only
(xla/service/cpu/cpu_compiler.cc, CodeGenOptLevel), after XLA has assigned the buffers, and
the plans are the same to the byte (12 of the default transformer's, at micro-batch 1 and 32)
in 0.75x the time. The code the run itself compiles is left as it is.
"""

import math
import os
import time
from dataclasses import dataclass

from runner.core.process import in_fresh_processes
from runner.core.units import mib
from runner.estimate.xla_plan import Ledger, NotCompiled
from runner.plan.line import estimate_line, time_factor
from runner.plan.probe import measured_line
from runner.plan.timing import accumulation_ratio
from runner.train.optimizer import resolve_jit

# At most this many processes compile a table's plans at once: each holds TensorFlow and a
# model (about 1 GiB resident), and a table has a dozen or two rows.
MAX_PROCESSES = 4
# The children's compile option (see above); XLA reads XLA_FLAGS once, when it first compiles.
FAST_CODEGEN = "--xla_backend_optimization_level=0"


@dataclass
class Row:
    precision: str
    checkpointing: str
    micro_batch: int | None
    accum: int | None
    predicted_MiB: float | None
    fits: bool
    time_ratio: float
    time_from: str
    measured_MiB: float | None = None
    note: str = ""
    attention: str = ""  # the transformer's model.attention; "" for other models

    def command(self) -> str:
        attention = f" model.attention={self.attention}" if self.attention else ""
        return (
            f"precision={self.precision} checkpointing={self.checkpointing}{attention} "
            f"data.batch_size={self.micro_batch} accum={self.accum}"
        )


@dataclass(frozen=True)
class Setting:
    """What every row of a table shares: the data's spec, the device, the target batch, the
    usable bytes, fp32/none's FLOPs (the time ratios' reference) and the job's timed factors
    (runner/plan/timing.py; None: FLOPs and the stored ratios)."""

    spec: object
    on_gpu: bool
    device_name: str
    effective: int
    usable: float
    base_flops: float
    timed: dict | None = None


def row(cfg, at: Setting, ledger: Ledger | None = None) -> Row:
    """cfg's row (its precision, checkpointing policy and attention kind), each XLA plan it
    reads written down in `ledger`."""
    note = ""
    attention = cfg.model.attention if cfg.model.name == "transformer" else ""
    try:
        line, hardware = estimate_line(cfg, at.spec, at.on_gpu, at.device_name, ledger, at.usable)
        if line.per_sample is None:  # activations not modelled: measured
            what = (
                f"not modelled: {line.unmodelled}"
                if line.unmodelled
                else "activations not modelled"
            )
            line, _ = measured_line(cfg, line, at.effective)
            note = f"probed, not predicted ({what})"
    except ValueError as err:  # a policy the model cannot take; probes out of memory
        p, c = cfg.precision.name, cfg.checkpointing.policy
        return Row(p, c, None, None, None, False, math.inf, "-", note=str(err), attention=attention)
    b = line.largest_fit(at.effective, at.usable)
    k = at.effective // b if b else None
    predicted = line.peak(b, k) if b else line.peak(1, at.effective)
    jit = resolve_jit(cfg.trainer.jit_compile, cfg.model.name, at.on_gpu)
    timed = at.timed
    time_ratio, time_from = _time(cfg, at.on_gpu, jit, hardware / at.base_flops, timed, attention)
    if timed and k and k > 1:
        time_ratio += accumulation_ratio(timed, k, at.effective)
        time_from += f" + {k - 1} micro-batch{'es' if k > 2 else ''} timed"
    precision, policy = cfg.precision.name, cfg.checkpointing.policy
    fits = b is not None
    return Row(
        precision, policy, b, k, mib(predicted), fits, time_ratio, time_from, note=note,
        attention=attention,
    )  # fmt: skip


def _time(cfg, on_gpu, jit, flops_ratio, timed, attention) -> tuple[float, str]:
    """A row's step-time ratio to fp32/none before accumulation, and where it came from: its
    policy's and precision's factors timed on the job where they were (timed, for the
    reference's attention kind), else FLOPs and the benchmarks' stored ratio (time_factor)."""
    factor, time_from = time_factor(cfg, on_gpu, jit)
    if not timed:
        return flops_ratio * factor, time_from
    policy, precision, parts = cfg.checkpointing.policy, cfg.precision.name, []
    if attention == timed["attention"] and policy in timed["policy"]:
        flops_ratio = timed["policy"][policy]
        parts.append(f"{policy} {flops_ratio:.2f}")
    elif policy != "none" or attention != timed["attention"]:
        kind = "" if attention == timed["attention"] else f"{attention} "
        parts.append(f"{kind}{policy} by FLOPs")
    if precision in timed["precision"]:
        factor = timed["precision"][precision]
        parts.append(f"{precision} {factor:.2f}")
    elif precision != "fp32":
        parts.append(f"{precision} {time_from}")
    return flops_ratio * factor, f"timed on the job: {', '.join(parts) or 'fp32/none'}"


def _row_apart(cfg, at: Setting) -> tuple[Row, list]:
    """row() in a process of the table's: the row, and its plan reads."""
    ledger = Ledger()
    return row(cfg, at, ledger), ledger.reads


def processes() -> int:
    """How many processes compile a table's plans at once: the cores this process may use."""
    return min(MAX_PROCESSES, len(os.sched_getaffinity(0)))


def rows(jobs: list, at: Setting, ledger: Ledger | None = None) -> list[Row]:
    """Each job's row, in order. Where XLA plans them and the first job's plans are not in the
    cache (a table not computed before), every row is computed in fresh processes, as many at
    once as processes() allows, each compiling at FAST_CODEGEN on a CPU (a GPU's compile
    option is left as it is: not measured there); `ledger.processes` says how many, and
    `ledger.wall_s` how long they took."""
    n = min(processes(), len(jobs))
    if ledger is None or n < 2:
        return [row(job, at, ledger) for job in jobs]
    ledger.compile, looked = False, len(ledger.reads)  # the first row only looks in the cache
    try:
        first = row(jobs[0], at, ledger)
    except NotCompiled:
        first = None
        del ledger.reads[looked:]  # its processes read them again
    finally:
        ledger.compile = True
    if first is not None:  # compiled before: the rest from the cache (or compiled here)
        return [first, *(row(job, at, ledger) for job in jobs[1:])]
    flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), FAST_CODEGEN]))
    start = time.perf_counter()
    done = in_fresh_processes(
        _row_apart, [(job, at) for job in jobs], n, None if at.on_gpu else {"XLA_FLAGS": flags}
    )
    ledger.processes, ledger.wall_s = n, time.perf_counter() - start
    for _, reads in done:
        ledger.reads += reads
    return [r for r, _ in done]
