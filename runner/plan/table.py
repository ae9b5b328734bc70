"""`python -m runner.plan`'s table: one row per precision x checkpointing policy (x attention
kind, for the transformer: plan.attention), the largest micro-batch predicted to fit the budget
at the target batch, its peak and step time."""

import itertools
import math
from dataclasses import asdict

import tensorflow as tf
from omegaconf import DictConfig

from runner.config import with_option
from runner.core.text import table as fixed_width
from runner.estimate.xla_plan import Ledger
from runner.plan.line import UNMEASURED, budget, data_spec, device_info, step_flops, target_batch
from runner.plan.row import Row, Setting, rows
from runner.plan.timing import time_probes


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


def timings(cfg: DictConfig) -> dict | None:
    """The job's time factors for the plan's precisions and policies (timing.time_probes), with
    the attention kind they were timed with."""
    reference = job(cfg, "fp32", "none")
    timed = time_probes(reference, target_batch(cfg), cfg.plan.precisions, cfg.plan.policies)
    attention = cfg.model.attention if cfg.model.name == "transformer" else ""
    return {**timed, "attention": attention} if timed else None


def table(
    cfg: DictConfig, timed: dict | None = None, ledger: Ledger | None = None
) -> tuple[list[Row], int, str, float]:
    """One row per precision x checkpointing policy (x attention kind): at the target batch,
    the largest micro-batch predicted to fit, its accum, peak and step-time ratio to fp32/none.
    timed: the job's measured time factors (timing.time_probes); measured here when
    plan.time_probes is set and none is given; ledger: where each XLA plan read is written
    down (runner/estimate/xla_plan.py), and with one, plans not in the cache are compiled in
    several processes (runner/plan/row.py). Returns
    (rows sorted cheapest first, the budget, where it came from, the usable bytes)."""
    on_gpu, name = device_info()
    total, source = budget(cfg, on_gpu)
    usable = total * (1 - cfg.plan.margin)
    effective = target_batch(cfg)
    spec = data_spec(cfg)
    if timed is None and cfg.plan.time_probes:
        timed = timings(cfg)
    jobs = [
        job(cfg, precision, policy, attention)
        for precision in cfg.plan.precisions
        if _supported(precision, on_gpu)
        for policy, attention in itertools.product(cfg.plan.policies, attention_kinds(cfg))
    ]
    base_flops = step_flops(job(cfg, "fp32", "none"), spec)
    at = Setting(spec, on_gpu, name, effective, usable, base_flops, timed)
    found = sorted(rows(jobs, at, ledger), key=_cheapest_first)
    return found, total, source, usable


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
