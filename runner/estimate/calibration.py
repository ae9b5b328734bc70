"""The estimate's fitted constants: figures measured, not derived from what TensorFlow keeps,
each with where it was measured. The rules (runner/estimate/layer_rules.py, executor_rules.py)
and the closed forms read them; the transformer's constants under XLA on a CPU are
runner/estimate/xla_fitted.py's, fitted to XLA's plans where XLA's own plan cannot be had."""

# XLA on a CPU computes 16-bit policies largely in float32 (docs/findings.md). Re-measured with the
# allocator's pool grown first (issue 13; before it, peaks were the allocator's rounding):
# `python -m runner.bench precision_accum` and `memory`, one process per job, on a CPU with
# AVX512_BF16/AMX, put the transformer's peak under XLA at 0.94-0.97x float32 for bfloat16
# (activations kept as float32) and 1.23-1.26x for float16 (float32 copies beside the float16
# tensors; measured/estimate 0.95-0.98 at 6 bytes). Bytes per activation element (the
# transformer's sbh terms; its attention core's and dropout's bytes are xla_memory's
# CORE_BYTES and MASK_BYTES, read off XLA's plans):
CPU_XLA_BYTES = {"float32": 4, "mixed_bfloat16": 4, "mixed_float16": 2 + 4}
# Micro-batches of input the runner's pipeline (runner/feed/pipelines.py: map -> batch ->
# prefetch(AUTOTUNE)) holds during a step, the step's own included: measured between draws,
# synthetic images at 32-96 px, micro-batch 8-32, beside a consumer: 3.7-5.2 (3.0-4.8 again
# at accum 1, 2 and 4). On a GPU the pipeline's buffers are host memory: the device holds
# the step's own micro-batch only.
INPUT_MICRO_BATCHES = 4
# What TensorFlow's BFC allocator adds to a step's own allocations without XLA: it splits a
# free chunk only if the chunk is at least twice the request, and hands over a smaller one
# whole. **Measured**, not derived (which chunk is free when is the executor's order of
# allocations, which the walk does not follow): in allocation traces (TensorFlow's profiler)
# of 16 CNN jobs drawn at random (runner.bench.draws, seed 29: MobileNet v1-v3, EfficientNet
# B0-B3 and V2, DenseNet121, every precision), the step's allocations alive at its peak held
# 1.8-26.6% more than they asked for, 9.3% over all; in those of the transformer's 18
# calibration jobs without XLA (runner.bench estimate), 0.9-17.5% of the step's own, 7.3% over
# all. Not under XLA, whose buffers are its plan's.
ALLOCATOR_WASTE = 0.093
