"""Fit a memory budget (issue 17): the cheapest precision, checkpointing, micro-batch and accum
that reach the effective batch within a memory budget.

    python -m runner.plan [run.py overrides] plan.budget=8GiB    # estimate only: seconds
    python -m runner.plan ... plan.measure=true                  # rows that fit, probed
    python run.py accum=auto trainer.effective_batch_size=256 plan.budget=8GiB

- line: the prediction. The analytic estimate (runner/estimate/memory.py) is linear in the
  micro-batch b: peak(b) = fixed + b x per_sample, plus the float32 accumulation sum when
  accum > 1. The fixed part is params, gradients, optimizer slots and pruning masks.
- table: one row per precision x checkpointing policy; a row fits when its prediction is
  within the budget less `plan.margin`. Its time column is a prediction too: the hardware
  FLOPs of an optimizer step (checkpointing's recomputation included) against fp32 with no
  checkpointing, times the step-time ratio of the precision that tfmemlab's benchmarks
  measured on this device class, model family and XLA setting where there is one.
- probe: a few optimizer steps of the job in a fresh process, measuring the real peak.
- auto: `accum=auto` measures instead of trusting the estimate (run.py calls it before the
  run trains).
"""
