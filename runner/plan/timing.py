"""`plan.time_probes=true`: the plan's time column measured on the job itself. FLOPs and the
benchmarks' stored precision ratios miss what a job's own shapes do to its step time: small
micro-batches use a device less well and carry fixed costs (ops dispatched, the weights read
again, the gradients added to the sum); a 16-bit precision's cost depends on the layers' widths
(MobileNetV2 bfloat16: 1.03x fp32 at 96 px and width 1.0, 1.35x at 64 px and width 0.35, on
one CPU); recomputation costs less than its FLOPs where the backward is slower per FLOP.

A few probes (runner/plan/probe.py: fresh processes, uncapped, TIME_STEPS optimizer steps) of
fp32 with no checkpointing and of each precision and policy alone, in interleaved rounds,
give the factors a row's time is built from: policy x precision + what each micro-batch past
the first adds.
"""

from omegaconf import DictConfig

from runner.config import with_option
from runner.core.bootstrap import median
from runner.plan.probe import probe

TIME_STEPS = 8  # a timing probe's optimizer steps (the first, which compiles, is not timed)
# Interleaved rounds (A B C A B C); each figure is the median of its rounds. Three, so that one
# slow round is set aside (the median of two is their mean): on a 2-core AMD EPYC one probe of
# fp32/none read 75.1 ms a step and the next two 53.5 and 48.6; with two rounds the plan took
# every 16-bit and `selective` row for 0.67-0.73x fp32/none, measured 1.05-1.21x.
TIME_ROUNDS = 3


def time_probes(
    reference: DictConfig, effective: int, precisions, policies, rounds: int | None = None
) -> dict | None:
    """The job's step-time factors, measured: `reference` is the plan's fp32 with no
    checkpointing. It is timed at the target batch in one micro-batch (2m samples, m =
    effective // 2; `effective` itself when it cannot be split) and at m in two; each other
    precision and policy is timed alone at the same size as the first.

    Returns {"step_s": the first's step, "micro_batch": m (0: not split), "extra_s": what the
    second micro-batch added, "precision": {name: step ratio to fp32}, "policy": {name: step
    ratio to none}}, a factor missing where its probe failed (out of memory, a policy the
    model cannot take); None when the reference itself fails. rounds: TIME_ROUNDS unless
    given."""
    rounds = TIME_ROUNDS if rounds is None else rounds
    m = effective // 2
    whole = 2 * m if m else effective
    jobs = {("base",): (reference, whole, 1)}
    if m:
        jobs["split",] = (reference, m, 2)
    for name in precisions:
        if name != "fp32":
            jobs["precision", name] = (with_option(reference, "precision", name), whole, 1)
    for name in policies:
        if name != "none":
            jobs["policy", name] = (with_option(reference, "checkpointing", name), whole, 1)
    times: dict[tuple, list[float]] = {key: [] for key in jobs}
    for _ in range(rounds):
        for key, (cfg, b, accum) in jobs.items():
            try:
                result = probe(cfg, b, accum, capped=False, steps=TIME_STEPS)
            except ValueError:  # a policy this model cannot take
                continue
            if not result["oom"] and result["step_s"]:
                times[key].append(result["step_s"])
    if not times["base",]:
        return None
    base = median(times["base",])
    out = {"step_s": base, "micro_batch": m, "extra_s": 0.0, "precision": {}, "policy": {}}
    if times.get(("split",)):
        out["extra_s"] = max(0.0, median(times["split",]) - base)
    for key, values in times.items():
        if len(key) == 2 and values:
            out[key[0]][key[1]] = median(values) / base
    return out


def accumulation_ratio(timed: dict | None, accum: int | None, effective: int) -> float:
    """The step-time ratio that `accum` micro-batches add to a row: each past the first costs
    extra_s, over the step of the effective batch in one (step_s scaled from the probes' 2m
    samples to `effective`, as FLOPs scale)."""
    if not timed or not timed["micro_batch"] or not accum or accum <= 1:
        return 0.0
    whole = timed["step_s"] * effective / (2 * timed["micro_batch"])
    return (accum - 1) * timed["extra_s"] / whole
