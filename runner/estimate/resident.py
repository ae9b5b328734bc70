"""What a job holds beside its step's own buffers, for every estimate: its variables and the
input micro-batches the pipeline holds."""

import math

import tensorflow as tf

from runner.estimate.calibration import INPUT_MICRO_BATCHES


def nbytes(variables) -> int:
    """Bytes of variables in their own dtypes."""
    return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables)


def inputs_bytes(shapes: list[tuple], b: int, on_gpu: bool = False) -> int:
    """The input micro-batches the pipeline holds (INPUT_MICRO_BATCHES; on a GPU the step's
    own) of inputs shaped `shapes` (an example's), in float32 or int32."""
    micro_batches = 1 if on_gpu else INPUT_MICRO_BATCHES
    return micro_batches * b * sum(math.prod(shape) for shape in shapes) * 4
