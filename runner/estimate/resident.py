"""What a job holds beside its step's own buffers, for every estimate: its variables and the
input micro-batches the pipeline holds."""

import math

import tensorflow as tf

from runner.estimate.calibration import INPUT_MICRO_BATCHES


def nbytes(variables) -> int:
    """Bytes of variables in their own dtypes."""
    return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables)


def inputs_bytes(model, b: int, on_gpu: bool = False) -> int:
    """The input micro-batches the pipeline holds (INPUT_MICRO_BATCHES; on a GPU the step's
    own), in float32."""
    micro_batches = 1 if on_gpu else INPUT_MICRO_BATCHES
    return micro_batches * b * sum(math.prod(t.shape[1:]) for t in model.inputs) * 4
