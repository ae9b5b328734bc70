"""`accum=auto`: the micro-batch and accum that reach trainer.effective_batch_size within
plan.budget, chosen by measurement (run.py calls `auto` before the run trains).

Short probes (runner/plan/probe.py: 3 optimizer steps, each in a fresh process, without a CPU
allocator limit) at two micro-batch sizes fit peak(b) = fixed + b x per_sample; the largest b
that divides the effective batch and is predicted within the budget less the margin is
confirmed by one more probe run as the job will run (under the limit, if one is set), and the
run trains with accum = effective / b.
"""

from dataclasses import asdict, dataclass

import tensorflow as tf
from omegaconf import DictConfig

from runner.config import with_batch
from runner.core.errors import PlanError
from runner.core.units import mib, size
from runner.plan.line import CAP, Line, budget, divisors, target_batch
from runner.plan.probe import estimate_apart, measured_line, probe


@dataclass
class Goal:
    """What accum=auto aims at: the effective batch within the budget less the margin."""

    effective: int
    total: int  # the budget, bytes
    source: str  # where the budget came from
    usable: float  # the budget less plan.margin


def _too_small(line: Line, goal: Goal) -> PlanError:
    parts = ", ".join(f"{k} {size(v)}" for k, v in line.parts.items() if v)
    accumulation = line.accumulation if goal.effective > 1 else 0
    if accumulation:
        parts += f", accumulation sum {size(accumulation)}"
    return PlanError(
        f"the budget of {size(goal.total)} ({goal.source}) is below what this job keeps "
        f"whatever its micro-batch: {size(line.fixed + accumulation)} ({parts}; "
        f"{size(goal.usable)} usable after plan.margin). Shrink it with a smaller model "
        "(model.*), trainer.optimizer=sgd (no slots; adam keeps two float32 slots per weight), "
        "or give a larger budget; precision does not shrink it here (Keras keeps float32 "
        "variables, gradients and slots under mixed policies)"
    )


def _probe_sizes(candidates: list[int], guess: int) -> tuple[int, int]:
    """Two micro-batch sizes below the estimate's guess, about a quarter and half of it."""
    below = [b for b in candidates if b <= guess] or candidates[:1]
    low = max([b for b in below if b <= guess / 4] or below[:1])
    high = max(
        [b for b in below if b <= guess / 2 and b > low]
        or [b for b in candidates if b > low][:1]
        or [low]
    )
    return low, high


def _fit(cfg: DictConfig, line: Line, goal: Goal, low: int, high: int) -> tuple[Line, list]:
    """The line through the probes' measured peaks (one probe: the estimate's slope), and the
    probes. What the tensors need: no CPU allocator limit (probe())."""
    effective = goal.effective
    probes = [probe(cfg, b, effective // b, capped=False) for b in dict.fromkeys((low, high))]
    measured = [p for p in probes if not p["oom"]]
    if len(measured) == 2:
        (b1, p1), (b2, p2) = ((p["micro_batch"], p["peak_bytes"]) for p in measured)
        slope = (p2 - p1) / (b2 - b1)
        fixed = p1 - slope * b1
    elif measured:  # one size only (the effective batch allows no other): the estimate's slope
        slope = line.per_sample
        fixed = measured[0]["peak_bytes"] - slope * measured[0]["micro_batch"]
    else:
        raise PlanError(
            f"accum=auto: the probes ran out of memory at micro-batch {low} (and {high}), "
            f"where the estimate predicts {size(line.peak(low, effective // low))} within the "
            f"budget of {size(goal.total)} ({goal.source}): TensorFlow needs more than the "
            "estimate counts here; give a larger budget, or set data.batch_size and accum "
            "yourself"
        )
    # Probes with accum > 1 hold the accumulation sum; a micro-batch of the whole effective
    # batch (accum 1) does not.
    with_sum = all(p["accum"] > 1 for p in measured)
    return Line(fixed - (line.accumulation if with_sum else 0), line.accumulation, slope), probes


def _confirm(cfg: DictConfig, fitted: Line, goal: Goal, probes: list) -> tuple[int, list]:
    """The largest micro-batch the fit predicts within the budget, confirmed by a probe as the
    run will train (under the limit, if any), stepping down until one fits."""
    candidates = divisors(goal.effective)
    choice = fitted.largest_fit(goal.effective, goal.usable)
    confirmations = []
    while choice is not None:
        check = probe(cfg, choice, goal.effective // choice)
        confirmations.append(check)
        if not check["oom"] and check["peak_bytes"] <= goal.total:
            return choice, confirmations
        smaller = [b for b in candidates if b < choice]
        choice = max(smaller) if smaller else None
    smallest = confirmations[-1] if confirmations else probes[0]
    seen = "ran out of memory" if smallest["oom"] else f"peaked at {size(smallest['peak_bytes'])}"
    raise PlanError(
        f"accum=auto: no micro-batch fits the budget of {size(goal.total)} ({goal.source}): at "
        f"micro-batch {smallest['micro_batch']} the job {seen}, and the fit predicts "
        f"{size(fitted.peak(1, goal.effective))} at micro-batch 1; give a larger budget, or "
        "shrink the job (checkpointing, a smaller model)"
    )


def auto(cfg: DictConfig, log=print) -> tuple[DictConfig, dict]:
    """accum=auto: cfg with the micro-batch and accum chosen by measurement (module
    docstring), and the plan's record (for plan.json). PlanError when nothing fits."""
    total, source = budget(cfg, bool(tf.config.list_physical_devices("GPU")))
    goal = Goal(target_batch(cfg), total, source, total * (1 - cfg.plan.margin))
    line = estimate_apart(cfg)
    if line.per_sample is None:  # activations not modelled (a subclassed model): measure them
        log("tfmemlab: accum=auto: the estimate does not model this model's activations; probing")
        line, _ = measured_line(cfg, line, goal.effective)
    if line.fixed + (line.accumulation if goal.effective > 1 else 0) > goal.usable:
        raise _too_small(line, goal)
    guess = line.largest_fit(goal.effective, goal.usable) or 1
    low, high = _probe_sizes(divisors(goal.effective), guess)
    log(
        f"tfmemlab: accum=auto: effective batch {goal.effective}, budget {mib(total):.1f} MiB "
        f"({source}; {mib(goal.usable):.1f} MiB usable); the estimate says micro-batch "
        f"{guess}; probing {low} and {high}"
    )
    fitted, probes = _fit(cfg, line, goal, low, high)
    disagree = abs(fitted.per_sample - line.per_sample) / max(abs(line.per_sample), 1.0)
    if disagree > 0.25:
        log(
            f"tfmemlab: accum=auto: the measured slope ({mib(fitted.per_sample):.3f} MiB per "
            f"example) and the estimate's ({mib(line.per_sample):.3f}) differ by "
            f"{disagree:.0%}; the measurement is used"
        )
    choice, confirmations = _confirm(cfg, fitted, goal, probes)
    accum = goal.effective // choice
    record = {
        "effective_batch_size": goal.effective,
        "budget_bytes": total,
        "budget_from": source,
        "margin": cfg.plan.margin,
        "usable_bytes": goal.usable,
        "estimate": {"line": asdict(line), "micro_batch": guess},
        "fit": {
            "fixed_bytes": fitted.fixed,
            "per_sample_bytes": fitted.per_sample,
            "slope_vs_estimate": disagree,
        },
        "probes": probes + confirmations,
        "micro_batch": choice,
        "accum": accum,
        "predicted_peak_bytes": fitted.peak(choice, accum),
        "measured_peak_bytes": confirmations[-1]["peak_bytes"],
    }
    limit = confirmations[-1]["cpu_limit_MiB"]
    log(
        f"tfmemlab: accum=auto: data.batch_size={choice} accum={accum} (effective "
        f"{goal.effective}); predicted peak {mib(record['predicted_peak_bytes']):.1f} MiB, "
        f"measured {mib(record['measured_peak_bytes']):.1f} MiB"
        + (f" under {CAP}={limit} (a small pool rounds more)" if limit else "")
        + f", budget {mib(total):.1f} MiB"
    )
    return with_batch(cfg, choice, accum), record
