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


# The standard attention core's backward without XLA (transformer_form.core_workspace): bytes
# per scores element (a s^2 b) of the softmax's float32 temporaries and the probabilities'
# gradients, (without dropout, with it), fitted to measured BFC peaks on this CPU (4 runs of
# 18 jobs at s=256, b=8, h=32, 4 heads, 2 layers: 3 precisions x dropout 0/0.1 x
# none/blocks/selective), whatever the policy. On the bytes requested (the allocator's traces
# of those 18 jobs, its rounding apart) the jobs without dropout needed 3.03-3.24 in float32
# and 5.24-5.34 at 16 bits.
CORE_WORKSPACE = {"float32": (3.2, 3.6), "16-bit": (5.0, 3.4)}


# The transformer under XLA on a CPU where XLA's own plan of the step is not read (a
# tf.distribute strategy: xla_fitted.py): figures read off and fitted to XLA's plans.
EXTRA_PER_LAYER = 4  # sbh elements a layer keeps beyond the paper's 16sbh
LAYER_GRADIENTS = {"none": 6, "rebuilt": 5}  # sbh float32 beside the kept activations
LOSS_GRADIENTS = 3  # sbh float32 beside the logits and their gradient
# In the attention's backward the MLP's activations (9sbh in the paper, and the 4sbh more) are
# freed, and the scores' gradients are alive beside the float32 softmax: as^2b float32 x 1.14
# (fitted, float32 without dropout, 8 heads, 256 tokens). What else the core kept (dropout's
# output and draw, the 16-bit rounding) is freed as they are made, so the core holds the larger
# of the two (score_moment). Read off XLA's plans of a rebuilt layer with 9 heads of 247
# tokens (h=63, batch 14, `every`): under float32 and bfloat16 with dropout the peak held the
# core's kept tensors and the MLP's, no scores' gradient (measured/estimate 0.86 and 0.82
# when the gradients were counted on top of the core).
SCORE_GRADIENTS = 1.14
MLP_KEPT = 9 + EXTRA_PER_LAYER
# At micro-batch 1 XLA drops the batch dimension, and the CPU backend's two backward dots that
# contract over the queries (dV = P^T dO, dK = dS^T Q) read transposed float32 copies of P and
# of the scores' gradient (a `transpose` + `copy` fusion each, dimensions {0,1,3,2}), made
# beside the tensors they copy, which the other dots still read; at micro-batch 2 and more the
# dots read them in place. So the attention's backward holds one float32 as^2b more at batch 1.
# Read off the plans of one layer, 9 heads, 247 tokens, h=63, `every` (and seed 672810's draw
# 14: 16 heads, 155 tokens, accum 2): under bfloat16 with dropout two float32 and two bfloat16
# as^2b buffers at the peak (one float32 at batch 2 and 4; measured/estimate 1.29-1.32 without
# the copy); under the other policies the copies leave holes in XLA's heap instead (0.5-1.5
# as^2b float32 above the live peak: float32 without dropout takes four as^2b slots for two).
TRANSPOSED_COPY = 4


# Bytes per element of the attention's as^2b that a layer keeps, (without dropout, with it),
# and per element of a dropout mask, by precision policy. Read off XLA's plans on a CPU (h=64,
# 3 layers, 4 heads, 128 tokens, batch 8; `*buffer-assignment.txt`, live at the peak): XLA's
# CPU backend computes the dots in float32 and keeps 16-bit values as 16-bit tensors beside
# the float32 ones computed from them (tests/test_memory_figures.py checks the estimate
# against XLA's plan on the machine the suite runs on).
# - float32: the softmax (4); with dropout, its float32 output and the uniform draw's 32
#   random bits (12).
# - bfloat16: the float32 softmax and its bfloat16 rounding, which feeds the next dot (6);
#   with dropout, the uniform draw made in bfloat16 (8): dropout's product is fused into the
#   next dot's operand and not kept.
# - float16: the float32 softmax and a float32 copy of its float16 rounding (8); with
#   dropout, the draw's 16 random bits (10).
# - a chunked core with one key block under a 16-bit policy (ONE_BLOCK_16BIT): it computes in
#   float32, and keeps two float32 tensors of its scores' size, not float32's one (8); with
#   dropout float32's three (12). Read off the plans of a 6-layer transformer (15 heads, 103
#   tokens, blocks of 128, batch 5, no dropout): 12 float32 as^2b buffers at the peak in
#   bfloat16 and in float16, 6 in float32 (measured/estimate 2.16 under selective, 1.39 under
#   none, 1.035 in float32); with dropout seed 29's draw 59 (bfloat16) read 1.01 at 12.
ONE_BLOCK_16BIT = "chunked_one_block_16bit"
CORE_BYTES = {
    "float32": (4, 12), "mixed_bfloat16": (6, 8), "mixed_float16": (8, 10), ONE_BLOCK_16BIT: (8, 12)
}  # fmt: skip
MASK_BYTES = {"float32": 4, "mixed_bfloat16": 2, "mixed_float16": 2, ONE_BLOCK_16BIT: 4}
# Under bfloat16 the MLP's GELU output (4sbh), the down projection's operand, is kept as
# bfloat16 alone (the same plans: 2 bytes an element where float32 keeps 4; float16 keeps a
# float32 copy): bytes a layer's sbh terms keep less than (16 + EXTRA_PER_LAYER) x p.
MLP_16BIT_SAVING = {"float32": 0, "mixed_bfloat16": 4 * 2, "mixed_float16": 0}
# Constants a layer's forward and backward leave in a traced step without XLA, each in one of
# BFC's 256-byte chunks (runner/estimate/small_tensors.py): (on an input shape new to its
# kind, on one seen). **Counted**, not derived: the allocator's bytes kept after the runner's
# step (Adam, accum 4) traced and run, in chains of one kind at 12x12x8, micro-batch 3, one
# layer against three; seed 5050's draw 41 (a group-norm CNN, 0.49 MiB) kept 205 at its peak.
CONSTANTS = {
    "GroupNormalization": (39, 29), "LayerNormalization": (27, 21),
    "BatchNormalization": (22, 15), "Conv2D": (10, 5.5), "Dense": (8, 6),
    "Activation:gelu": (3, 0), "MaxPooling2D": (0.5, 0.5),
}  # fmt: skip
# The step's own (the loss's, the accumulation's, the update's): 13-23 counted under SGD and
# Adam at accum 1 and 4; the most.
STEP_CONSTANTS = 23
