"""The scratch buffer a convolution's backward allocates on a CPU without oneDNN, for the
backward walk (runner/estimate/graph_walk.py).

TensorFlow's default CPU kernels for Conv2DBackpropFilter and Conv2DBackpropInput
(Conv2DCustomBackpropFilterOp, Conv2DCustomBackpropInputOp in tensorflow/core/kernels/
conv_grad_filter_ops.cc and conv_grad_input_ops.h) compute through an im2col buffer of
`shard x output_image_size x filter_total_size` elements, whose shard of images is sized to a
30 MiB working set (the L3 size the kernels assume), whatever the batch:

    A = O * F,  B = O * Cout,  C = F * Cout     (O: output pixels, F: kh * kw * Cin)
    shard = ceil((30 MiB / element size) / (A + B + C))

(the input's kernel takes one image at a time when the batch is 1 or each thread's share of
A + B + C reaches 256 KiB). So a small convolution holds a buffer of up to 30 MiB during its
backward: MobileNet's first convolution (3x3, 3 to 32 channels, 26x26 outputs) 13.4 MiB, at
batch 1 or 12 alike; measured in a step of a model cut after it, 13.7 MiB above the resting
state against 0.3 MiB of tensors. With oneDNN's operations on (TF_ENABLE_ONEDNN_OPTS=1, the
default on CPUs with AVX512_VNNI or AMX) the convolutions go through oneDNN instead, whose
scratch is small: the same step read 1.0 MiB.

The allocator may serve such a request from a larger free chunk (the BFC allocator does not
split a chunk less than twice the request): 23.3 MiB requested read 32 MiB. That rounding
depends on what was freed before and is not modelled.
"""

import math
import os

from runner.core.machine import cpu_onednn_bf16, cpu_onednn_fp16

WORKING_SET = 30 * 2**20  # bytes: the kernels' assumed L3 size
L2 = 256 * 2**10  # bytes: the input kernel's per-thread threshold
CONVOLUTIONS = {"Conv2D", "Conv1D"}


def onednn() -> bool:
    """Whether TensorFlow runs its oneDNN operations in this process (read at run time: the
    default depends on the CPU's features)."""
    try:
        from tensorflow.python.util import _pywrap_util_port  # not a public API
    except ImportError:
        return os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "1"
    return bool(_pywrap_util_port.IsMklEnabled())


def onednn_convolutions(policy: str) -> bool:
    """Whether oneDNN computes this policy's convolutions on this CPU: float16's where
    TensorFlow gives float16 to oneDNN (machine.cpu_onednn_fp16: elsewhere MobileNetV2 at
    96x96 under `mixed` held two 23.3 MiB buffers with oneDNN on), bfloat16's where it gives
    bfloat16 to oneDNN (machine.cpu_onednn_bf16). Measured with the
    allocator's trace of one step: on a CPU with AVX512F and no AVX512_BF16, MobileNet and
    MobileNetV2 in bfloat16 held no im2col buffer; on one without AVX512, oneDNN on, the
    example U-Net at 16 px, batch 64, peaked at 75.0 MiB in bfloat16 against 9.3 in float32
    (TensorFlow's own kernels)."""
    if not onednn():
        return False
    if policy == "mixed_float16":
        return cpu_onednn_fp16()
    return policy != "mixed_bfloat16" or cpu_onednn_bf16()


def im2col(op) -> bool:
    """Whether a layer's backward goes through the im2col kernels above: a Conv2D's or Conv1D's,
    not grouped (under TensorFlow's own CPU kernels; the caller decides that)."""
    if type(op).__name__ not in CONVOLUTIONS or getattr(op, "kernel", None) is None:
        return False
    return getattr(op, "groups", 1) <= 1


def scratch_bytes(op, batch: int, width: int, input_gradient: bool, threads: int) -> int:
    """Bytes of the im2col buffers a Conv2D's (or Conv1D's) backward allocates at micro-batch
    `batch` and `width` bytes per element: the filter gradient's, and the input gradient's
    when the layer's input needs one (not a model input). 0 for other layers, and under
    XLA's or oneDNN's kernels (the caller decides)."""
    if not im2col(op):
        return 0
    kernel = op.kernel
    out_pixels = math.prod(op.output.shape[1:-1])
    filter_total = math.prod(kernel.shape[:-1])
    cout = kernel.shape[-1]
    work = out_pixels * filter_total + out_pixels * cout + filter_total * cout
    column = out_pixels * filter_total * width  # bytes of one image's im2col
    shard = math.ceil(WORKING_SET / width / work)
    nbytes = shard * column  # the filter gradient's
    if input_gradient:
        parallel = batch == 1 or work // max(threads, 1) >= L2 // width
        nbytes += (1 if parallel else shard) * column
    return nbytes
