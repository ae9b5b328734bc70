"""`python -m runner.plan`'s table: one row per precision x checkpointing policy (x attention
kind, for the transformer: plan.attention), the largest micro-batch predicted to fit the budget
at the target batch, its peak and step time."""

import itertools
import math
from dataclasses import asdict, dataclass

import tensorflow as tf
from omegaconf import DictConfig

from runner.config import with_option
from runner.core.text import table as fixed_width
from runner.core.units import mib
from runner.plan.line import (
    UNMEASURED,
    budget,
    data_spec,
    device_info,
    estimate_line,
    target_batch,
    time_factor,
)
from runner.plan.probe import measured_line
from runner.plan.timing import accumulation_ratio, time_probes
from runner.train.optimizer import resolve_jit


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


def job(cfg: DictConfig, precision: str, policy: str, attention: str = "") -> DictConfig:
    """cfg with this precision and checkpointing policy (their conf/ options), and for the
    transformer this attention kind ("": the config's own)."""
    out = with_option(with_option(cfg, "precision", precision), "checkpointing", policy)
    if attention:
        out.model.attention = attention
    return out


def attention_kinds(cfg: DictConfig) -> list[str]:
    """The attention kinds the table has rows for: plan.attention for the transformer, none
    (one row per precision and policy) for other models."""
    return list(cfg.plan.attention) if cfg.model.name == "transformer" else [""]


def _cheapest_first(row: Row) -> tuple:
    """Rows that fit, by predicted time; at equal times a time that is fp32's or measured
    before a guess (a precision with no measured ratio), then fewer accumulation steps (FLOPs
    do not see that small micro-batches use a device less well), then the lower peak."""
    guessed = row.time_from.startswith(UNMEASURED)
    return (
        not row.fits,
        row.time_ratio,
        guessed,
        row.accum or math.inf,
        row.predicted_MiB or math.inf,
    )


def _supported(name: str, on_gpu: bool) -> bool:
    """Whether the device runs the precision: float16 and bfloat16 on a GPU need compute
    capability 7.0 and 8.0; a CPU emulates what it lacks (runner/techniques/precision.py)."""
    if not on_gpu or name == "fp32":
        return True
    details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
    major = (details.get("compute_capability") or (0, 0))[0]
    return major >= (8 if name == "bf16" else 7)


def _row(
    cfg, spec, on_gpu, name, effective, usable, base_flops, timed=None, ledger=None
) -> tuple[Row, float | None]:
    """One row of the table, and the FLOPs of fp32/none once they are known; timed: the job's
    measured time factors (runner/plan/timing.py), which replace FLOPs and stored ratios."""
    note = ""
    attention = cfg.model.attention if cfg.model.name == "transformer" else ""
    try:
        line, hardware = estimate_line(cfg, spec, on_gpu, name, ledger)
        if line.per_sample is None:  # activations not modelled: measured
            what = (
                f"not modelled: {line.unmodelled}"
                if line.unmodelled
                else "activations not modelled"
            )
            line, _ = measured_line(cfg, line, effective)
            note = f"probed, not predicted ({what})"
    except ValueError as err:  # a policy the model cannot take; probes out of memory
        p, c = cfg.precision.name, cfg.checkpointing.policy
        row = Row(p, c, None, None, None, False, math.inf, "-", note=str(err), attention=attention)
        return row, base_flops
    if base_flops is None:  # the time ratios' reference: fp32, no checkpointing
        base_flops = estimate_line(job(cfg, "fp32", "none"), spec, on_gpu, name)[1]
    b = line.largest_fit(effective, usable)
    k = effective // b if b else None
    predicted = line.peak(b, k) if b else line.peak(1, effective)
    jit = resolve_jit(cfg.trainer.jit_compile, cfg.model.name, on_gpu)
    time_ratio, time_from = _time(cfg, on_gpu, jit, hardware / base_flops, timed, attention)
    if timed and k and k > 1:
        time_ratio += accumulation_ratio(timed, k, effective)
        time_from += f" + {k - 1} micro-batch{'es' if k > 2 else ''} timed"
    row = Row(
        cfg.precision.name,
        cfg.checkpointing.policy,
        b,
        k,
        mib(predicted),
        b is not None,
        time_ratio,
        time_from,
        note=note,
        attention=attention,
    )
    return row, base_flops


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


def timings(cfg: DictConfig) -> dict | None:
    """The job's time factors for the plan's precisions and policies (timing.time_probes), with
    the attention kind they were timed with."""
    reference = job(cfg, "fp32", "none")
    timed = time_probes(reference, target_batch(cfg), cfg.plan.precisions, cfg.plan.policies)
    attention = cfg.model.attention if cfg.model.name == "transformer" else ""
    return {**timed, "attention": attention} if timed else None


def table(
    cfg: DictConfig, timed: dict | None = None, ledger: list | None = None
) -> tuple[list[Row], int, str, float]:
    """One row per precision x checkpointing policy (x attention kind): at the target batch,
    the largest micro-batch predicted to fit, its accum, peak and step-time ratio to fp32/none.
    timed: the job's measured time factors (timing.time_probes); measured here when
    plan.time_probes is set and none is given; ledger: each XLA plan read's (seconds, cached)
    is appended to it (runner/estimate/xla_plan.py). Returns
    (rows sorted cheapest first, the budget, where it came from, the usable bytes)."""
    on_gpu, name = device_info()
    total, source = budget(cfg, on_gpu)
    usable = total * (1 - cfg.plan.margin)
    effective = target_batch(cfg)
    spec = data_spec(cfg)
    rows, base_flops = [], None
    if timed is None and cfg.plan.time_probes:
        timed = timings(cfg)
    for precision in cfg.plan.precisions:
        if not _supported(precision, on_gpu):
            continue
        for policy, attention in itertools.product(cfg.plan.policies, attention_kinds(cfg)):
            row, base_flops = _row(
                job(cfg, precision, policy, attention),
                spec, on_gpu, name, effective, usable, base_flops, timed, ledger,
            )  # fmt: skip
            rows.append(row)
    rows.sort(key=_cheapest_first)
    return rows, total, source, usable


def text(rows: list[Row], measured: bool) -> str:
    """The table for the terminal."""
    columns = ["precision", "checkpointing", "micro_batch", "accum", "predicted_MiB", "fits"]
    if any(r.attention for r in rows):
        columns.insert(2, "attention")
    columns += ["measured_MiB"] if measured else []
    columns += ["time_ratio", "time_from"] + (["note"] if any(r.note for r in rows) else [])
    shown = [{**asdict(r), "fits": "yes" if r.fits else "no"} for r in rows]
    for r in shown:
        r["time_ratio"] = None if math.isinf(r["time_ratio"]) else r["time_ratio"]
    return fixed_width(shown, columns)
