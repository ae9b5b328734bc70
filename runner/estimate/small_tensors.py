"""The small tensors a job keeps for its whole run, each in a chunk of at least 256 bytes.

TensorFlow's BFC allocator (the CPU's, runner/core/start.py) rounds every request up to a
multiple of 256 bytes (tensorflow/core/common_runtime/bfc_allocator.h kMinAllocationSize,
RoundedBytes), so a tensor of a few bytes holds 256. A job keeps hundreds of them for good,
which the estimate's parts counted at their own size or not at all:
- each variable (the weights, the optimizer's slots and counters, the accumulation sums) is
  its buffer, rounded up, and its resource handle (VarHandleOp's output, a ResourceHandle of
  200 bytes asked for: one chunk);
- a traced step keeps the constants of its graph: int32 vectors and scalars of 4-20 bytes
  (a reshape's shape, a reduction's axes, a Tile's multiples) made while Python traces it
  (in the allocator's trace: no op name, one every 2-3 ms of the trace, alive to the run's
  end; which structure holds them, likely the graph's constant evaluation in shape
  inference, was not followed into TensorFlow's source), and the Const kernels' tensors of
  the graph grappler leaves (named, made at its first run: ConstantOp keeps its tensor).
  All are made at the step's first call and stay: a second call adds none.

How many constants a layer's forward and backward leave is its implementation's: counted,
not derived. Keras's GroupNormalization reshapes into groups with a shape it builds from
ops.shape (keras/src/layers/normalization/group_normalization.py _reshape_into_groups), takes
ops.moments over the group axes, broadcasts inv and res back and reshapes again: with its
gradients, 39 constants where a Conv2D leaves 10. Counted in the runner's step
(accumulation.make_train_step, Adam, accum 4), traced and run three times, the allocator's
bytes kept after it over 256, in chains of one kind (12x12x8, micro-batch 3): one layer of a
kind against three identical ones. Identical layers share some: grappler merges equal
constants, and a layer's shape constants equal those of a layer of its kind on the same input
shape; so a layer adds its kind's first count on an input size new to its kind (its elements
an example: the shape's stand-in), and the further count on one seen. Activation("gelu")'s
are scalars (0.5, sqrt(2)), shared by every layer of it whatever its shape.
The step's own (the loss, the accumulation, the update): the chain without a layer of the
kind (Conv2D 1x1, GlobalAveragePooling2D, a Dense head) kept 41 chunks under Adam at accum 4,
37 at accum 1, 35 and 31 under SGD: 41 less its Conv2D's and Dense's first counts, 23 (13-23).

Measured on seed 5050's draw 41 (groupnorm_cnn filters=4 depth=3 groups=1 px=23 b=3 accum=4
fp32, blocks): at the step's peak the allocator held 535,808 bytes for 410,715 asked, 380
allocations of which 205 were constants (52 KiB held for 2.3 KiB asked) and 59 variable
handles (15 KiB); the estimate read 0.40 MiB against 0.49-0.51 measured (1.24-1.28), its
own parts matching the bytes asked (415 KiB). The same model traced and run kept 83 chunks at
depth 1 and 170 at depth 3 (these counts: 84 and 183); with them the draw read 1.05-1.13
(its peak 0.49-0.52 MiB from run to run), seed 5050's other groupnorm_cnn draw (9, 19.7
MiB) 0.911 before and 0.907 after (its term 0.05 MiB). What the draw still lacks is the
large tensors' share: chunks BFC did not split held 53-74 KiB more than asked at its peak,
where ALLOCATOR_WASTE's 9.3% of the step reads 27 KiB. Kinds not counted here add none (the
estimate is a lower bound there).
"""

import math

from runner.estimate import layer_rules, model_graph, resident
from runner.estimate.calibration import CONSTANTS, STEP_CONSTANTS

CHUNK = 256  # BFC's least allocation, and the multiple it rounds every request to
HANDLE = CHUNK  # a variable's resource handle: 200 bytes asked, one chunk
SCALARS = {"Activation:gelu"}  # constants shared whatever the input's shape


def rounded(nbytes: int) -> int:
    """The bytes BFC holds for a request of `nbytes`, before any chunk splitting."""
    return max(CHUNK, math.ceil(nbytes / CHUNK) * CHUNK)


def variables_bytes(variables) -> int:
    """What the allocator holds beyond the variables' own bytes: each one's handle and its
    buffer's rounding."""
    extra = 0
    for v in variables:
        own = resident.nbytes([v])
        extra += HANDLE + rounded(own) - own
    return extra


def constants(model) -> float:
    """Constants the model's traced step keeps (CONSTANTS, STEP_CONSTANTS)."""
    ops, _, elements = model_graph.operations(model)
    count, seen = float(STEP_CONSTANTS), set()
    for _, op, ins, _ in ops:
        kind = layer_rules.kind(op)
        new, again = CONSTANTS.get(kind, (0, 0))
        key = kind if kind in SCALARS else (kind, *(elements[t] for t in ins))
        count += again if key in seen else new
        seen.add(key)
    return count


def small_tensors_bytes(model, optimizer, accum: int) -> int:
    """Bytes of the small tensors a job keeps beyond what its parts count (module docstring):
    its variables' handles and rounding (the weights, the optimizer's, the accumulation sums
    of an accumulating step) and its traced step's constants, each in one chunk."""
    variables = [*model.weights, *optimizer.variables]
    if accum > 1:
        variables += model.trainable_variables  # the float32 sums: their shapes
    return variables_bytes(variables) + int(constants(model) * CHUNK)
