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


def _row(cfg, spec, on_gpu, name, effective, usable, base_flops) -> tuple[Row, float | None]:
    """One row of the table, and the FLOPs of fp32/none once they are known."""
    note = ""
    attention = cfg.model.attention if cfg.model.name == "transformer" else ""
    try:
        line, hardware = estimate_line(cfg, spec, on_gpu, name)
        if line.per_sample is None:  # activations not modelled (a subclassed model): measured
            line, _ = measured_line(cfg, line, effective)
            note = "activations not modelled: peak from probes"
    except ValueError as err:  # a policy the model cannot take; probes out of memory
        p, c = cfg.precision.name, cfg.checkpointing.policy
        row = Row(p, c, None, None, None, False, math.inf, "-", note=str(err), attention=attention)
        return row, base_flops
    if base_flops is None:  # the time ratios' reference: fp32, no checkpointing
        base_flops = estimate_line(job(cfg, "fp32", "none"), spec, on_gpu, name)[1]
    jit = resolve_jit(cfg.trainer.jit_compile, cfg.model.name, on_gpu)
    factor, time_from = time_factor(cfg, on_gpu, jit)
    b = line.largest_fit(effective, usable)
    k = effective // b if b else None
    predicted = line.peak(b, k) if b else line.peak(1, effective)
    row = Row(
        cfg.precision.name,
        cfg.checkpointing.policy,
        b,
        k,
        mib(predicted),
        b is not None,
        hardware / base_flops * factor,
        time_from,
        note=note,
        attention=attention,
    )
    return row, base_flops


def table(cfg: DictConfig) -> tuple[list[Row], int, str, float]:
    """One row per precision x checkpointing policy (x attention kind): at the target batch,
    the largest micro-batch predicted to fit, its accum, peak and step-time ratio to fp32/none.
    Returns
    (rows sorted cheapest first, the budget, where it came from, the usable bytes)."""
    on_gpu, name = device_info()
    total, source = budget(cfg, on_gpu)
    usable = total * (1 - cfg.plan.margin)
    effective = target_batch(cfg)
    spec = data_spec(cfg)
    rows, base_flops = [], None
    for precision in cfg.plan.precisions:
        if not _supported(precision, on_gpu):
            continue
        for policy, attention in itertools.product(cfg.plan.policies, attention_kinds(cfg)):
            row, base_flops = _row(
                job(cfg, precision, policy, attention),
                spec, on_gpu, name, effective, usable, base_flops,
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
