"""The rules of a layer, by its kind: its forward FLOPs, what its backward keeps, and what its
backward holds while it runs. The estimate's walk (runner/estimate/graph_walk.py) and the per-layer
profile's rows (runner/measure/profile_rows.py) read them.

What a layer leaves for backward follows TensorFlow's gradient functions (graph mode, no
XLA): a layer's output is kept when its own gradient reads its output (ReLU's and softmax's
do: tensorflow/python/ops/nn_grad.py) or when a consumer's gradient reads its input (matmuls,
convolutions, normalisations, GELU). An output read only by an Add or a padding is not kept:
MobileNetV2 keeps the output of a convolution (BatchNorm reads it) and of its ReLU6, but
not the BatchNorm output between them (measured: MobileNetV2, 96x96, batch 8, float32, no
XLA: forward+backward peak 92.7 MiB over 8.5 MiB of gradients, against 122 MiB of op
outputs in all).
"""

import math

import keras

from runner.estimate.sequence_rules import (
    attention_sizes,
    recurrent_kept_bytes,
    recurrent_shape,
    recurrent_workspace_bytes,
)

# Gradients that read the layer's input, or its output (the rest read neither).
KEEPS_INPUT = {
    "Conv1D", "Conv2D", "DepthwiseConv2D", "SeparableConv2D", "Dense", "EinsumDense",
    "BatchNormalization", "LayerNormalization", "LayerNorm", "Multiply", "Embedding", "GELU",
    "attention_scores", "attention_context", "MaxPooling2D",
    "Activation:swish", "Activation:silu", "Activation:hard_swish",
    "Activation:hard_silu", "Activation:elu", "Activation:selu", "Activation:mish",
    "UnitNormalization", "GroupNormalization", "MultiHeadAttention",
    # LeakyReluGrad, the transposed convolutions' filter gradients, BatchMatMul's (Dot,
    # Attention), ResizeBilinearGrad and MaxPoolGrad read the input (measured: chains of each,
    # 4.0 bytes an element in float32, 2.0 in bfloat16; TimeDistributed(Dense) its Dense's)
    "LeakyReLU", "Activation:leaky_relu", "Conv2DTranspose", "Conv1DTranspose", "Dot",
    "Attention", "TimeDistributed", "Resizing", "MaxPooling1D",
}  # fmt: skip
KEEPS_OUTPUT = {
    "ReLU", "Softmax", "attention_softmax", "MaxPooling2D", "Activation:relu",
    "Activation:relu6", "Activation:sigmoid", "Activation:tanh", "Activation:softmax",
    "ELU", "Activation:exponential", "MaxPooling1D",  # EluGrad, Exp's gradient: y
}  # fmt: skip
# Upcast their 16-bit inputs to float32 (keras/src/layers/normalization, ops.nn) and keep
# that copy; models/memory_limited.py's LayerNorm keeps its 16-bit input instead.
# GroupNormalization too (group_normalization.py _apply_normalization), but its x * inv + res
# broadcasts inv per (example, group): it keeps no input-sized product (measured, chains of it
# at 8 and 32 groups: 4.0 bytes an element, float32 and bfloat16). UnitNormalization is
# x * rsqrt(sum(x^2)) in its compute dtype (keras/src/ops/nn.py normalize): Square's and the
# product's gradients read x (4.0 and 2.0 bytes an element).
NORMS = {"BatchNormalization", "LayerNormalization", "GroupNormalization"}


def input_keepers(half: bool) -> set:
    """The kinds whose backward reads their input as it was made: under a 16-bit policy not the
    norms, which keep a float32 copy of it instead (own_kept_bytes)."""
    return KEEPS_INPUT - NORMS if half else KEEPS_INPUT


# Tensors of its output's size (in its compute dtype) a layer keeps of its own for its
# gradient, in place of its input. keras.activations.gelu (approximate=False, the default of
# Activation("gelu"), ConvNeXt's) is tf.nn.gelu: 0.5x * erfc(-x/sqrt(2)) in four ops, whose
# gradients read x/2, -x/sqrt(2) and the erfc, not x (tensorflow/python/ops/nn_ops.py,
# math_grad.py). Measured, a chain of Activation("gelu") on 16x16x16x64: 13.0 bytes per
# element in float32, 7.0 in bfloat16 (3.25 and 3.5 tensors; the rest is the erfc gradient's
# square, which the executor computes ahead of the backward).
# keras.activations.hard_silu (MobileNetV3's hard-swish) is x * (relu6(x + 3) / 6) in three ops
# (keras/src/backend/tensorflow/nn.py): the product's gradient reads x and relu6(x + 3) / 6, the
# division's reads relu6(x + 3), Relu6's its output; so beside x it keeps two tensors.
# Measured, a chain of Activation("hard_swish") on 8x16x16x64: 12.0 bytes per element in
# float32, 6.0 in float16, 5.5 in bfloat16 (3, 3 and 2.75 tensors; the old rule kept x only).
# keras.activations.gelu(x, approximate=True) (registered by keras_hub as gelu_approximate) is
# tf.nn.gelu's tanh form, 0.5x * (1 + tanh(c(x + 0.044715 x^3))): the product's gradient reads
# 0.5x and 1 + tanh, Tanh's its output, Pow's 3x^2 (computed ahead), not x: 4 tensors
# (measured 16.0 bytes an element in float32, 8.0 in bfloat16 and float16). mish is
# x * tanh(softplus(x)) (keras/src/activations/activations.py): the product reads x and the
# tanh, Tanh its output, Softplus's gradient sigmoid(x), computed ahead: x and two of its own
# (measured 11-12 bytes an element in float32, 5.5-6 in 16 bits).
OWN_KEPT = {
    "Activation:gelu": 3, "Activation:hard_silu": 2, "Activation:hard_swish": 2,
    "Activation:gelu_approximate": 4, "Activation:mish": 2,
    # softplus's gradient reads sigmoid(x), computed ahead; GaussianDropout's Mul reads its
    # noise, AlphaDropout's its cast keep mask; PReLU is relu(x) - alpha * relu(-x): both relus
    "Activation:softplus": 1, "GaussianDropout": 1, "AlphaDropout": 1, "PReLU": 2,
}  # fmt: skip
# Bytes an output element a layer keeps of its own whatever its dtype: Dropout's bool keep
# mask (where_v2(rand >= rate, ...): _SelectGradV2 reads the condition), Maximum's and
# Minimum's bool comparison, a max pooling's uint8 workspace (oneDNN's MaxPool, seen in the
# allocation trace: 5.0 bytes an element in float32, 3.0 in bfloat16, where the rule read 4.0
# and 2.0). Measured in chains of each, float32 and bfloat16.
OWN_KEPT_BYTES = {"Dropout": 1, "Maximum": 1, "Minimum": 1, "MaxPooling1D": 1, "MaxPooling2D": 1}
# Elementwise activations whose gradient is one binary kernel (ReluGrad, Relu6Grad, SigmoidGrad,
# TanhGrad) that writes the input gradient over the output gradient it reads, when nothing else
# reads that (TensorFlow's forward_input_or_allocate_output): their backward takes no buffer.
# Measured, Activation("relu") after Dense(4096) at batch 1024: at its backward the allocator
# held its output and that gradient, 32.2 MiB requested (tests/test_backward_walk.py).
GRADIENT_IN_PLACE = {
    "ReLU", "Activation:relu", "Activation:relu6", "Activation:sigmoid", "Activation:tanh",
}  # fmt: skip
# Float32 tensors of its input's size a norm's backward computes beside its output gradient:
# Keras's BatchNormalization and LayerNormalization are composite ops (moments, then
# x * inv + res), whose gradients broadcast the mean's and the variance's gradients back
# (two Tiles) and scale the output gradient (a Mul). Seen alive together in an allocation
# trace of a chain of norms, float32 and bfloat16 (16x16x16x64).
NORM_TEMPORARIES = 3
# Forward FLOPs per output element of elementwise and normalising kinds (a convention, as
# in FLOP counters; the matmuls and convolutions are counted exactly): batch/layer norm:
# mean 1, variance 3, normalise, scale and shift 4; softmax: max, subtract, exp, sum,
# divide; GELU (erf form): scale, erf (~4), add, two multiplies; swish: sigmoid (~4) and a
# multiply. Padding, reshapes, embeddings (a gather) and casts do no arithmetic.
FLOPS_PER_ELEMENT = {
    "BatchNormalization": 8, "LayerNormalization": 8, "LayerNorm": 8, "Softmax": 5,
    "attention_softmax": 5, "Activation:softmax": 5, "GELU": 8, "Activation:gelu": 8, "ReLU": 1,
    "Activation:relu": 1, "Activation:relu6": 2,
    "Activation:swish": 5, "Activation:silu": 5, "Activation:sigmoid": 4,
    "Activation:hard_swish": 5, "Activation:hard_silu": 5, "Activation:tanh": 4,
    "Dropout": 2, "Rescaling": 2, "Normalization": 2, "loss": 6,
}  # fmt: skip
NO_ARITHMETIC = {
    "ZeroPadding2D", "Reshape", "Flatten", "Embedding", "Activation:linear", "InputLayer",
    "Cast", "ZerosLike", "Arange",
}  # fmt: skip


def kind(op) -> str:
    """The rules' name for a layer or op: its class, or Activation:<function>."""
    name = type(op).__name__
    if name == "Activation":
        return f"Activation:{getattr(op.activation, '__name__', 'unknown')}"
    if name == "Dropout" and not getattr(op, "rate", 0):
        return "Activation:linear"  # rate 0: an identity
    return name


def element_flops(kind_name: str, n_inputs: int, in_elements: int, out_elements: int) -> float:
    if kind_name in NO_ARITHMETIC:
        return 0.0
    if kind_name in ("Add", "Multiply", "Subtract", "Average", "Maximum"):
        return float((n_inputs - 1) * out_elements)
    if kind_name.startswith("GlobalAveragePooling") or kind_name.startswith("AveragePooling"):
        return float(in_elements)  # one add per input element
    # Unlisted kinds: one FLOP per output element, so they still show on the roofline.
    return float(FLOPS_PER_ELEMENT.get(kind_name, 1) * out_elements)


def kernel_flops(op, out_elements: int, out_channels: int) -> float | None:
    """2 x MACs (+ bias) of a layer with a kernel: the whole kernel is applied once per output
    position (output elements / output channels), as flops.kernel_macs counts it: Conv2D
    kh*kw*cin*cout, DepthwiseConv2D kh*kw*cin*multiplier, Dense in*out MACs per position."""
    kernel = getattr(op, "kernel", None)
    if not isinstance(kernel, keras.Variable):
        return None
    bias = out_elements if getattr(op, "bias", None) is not None else 0
    return 2.0 * math.prod(kernel.shape) * out_elements / out_channels + bias


def layer_flops(op) -> float:
    """Forward FLOPs of one example through a functional model's layer, by the rules above."""
    out_shape = op.output.shape
    out_elements = math.prod(out_shape[1:])
    flops = kernel_flops(op, out_elements, out_shape[-1])
    if flops is not None:
        return flops
    inputs = op._inbound_nodes[0].input_tensors
    in_elements = sum(math.prod(t.shape[1:]) for t in inputs)
    return element_flops(kind(op), len(inputs), in_elements, out_elements)


def own_kept_bytes(
    kind_name: str,
    out: int,
    into: int,
    width: int,
    half: bool,
    scaled: bool,
    op=None,
    grad_in: bool = True,
    scale_kept: bool = True,
) -> int:
    """Bytes a layer keeps of its own for its backward (freed by it), beyond the outputs its
    readers keep: out/into are its output's and input's elements, width the bytes of its
    compute dtype, half a 16-bit policy, scaled a norm with a learned scale (gamma).
    - a 16-bit norm's float32 copy of its input (kept_outputs);
    - a LayerNormalization with a scale multiplies its input by inv * gamma broadcast to the
      input's shape (keras/src/ops/nn.py _layer_normalization), which the product's gradient
      reads: one float32 tensor of the input's size (seen in an allocation trace of a chain of
      norms, float32 and bfloat16, beside the float32 copy under bfloat16);
    - OWN_KEPT's tensors (GELU's, mish's);
    - a MultiHeadAttention's query, key, value and context (on its dropout path Keras's einsum
      transposes copies of them, of the same size), and its scores: without dropout
      ops.dot_product_attention computes the softmax in float32 and keeps it and its scaled
      copy where the forward computes it (scale_kept: forward_keeps_scaled_softmax), and
      under a 16-bit policy the 16-bit probabilities too; with dropout the Softmax output,
      the dropped probabilities and the keep mask (1 byte). Measured, chains of
      self-attention (b 4, T 128-256, 4-8 heads): 1.000 of the rule with dropout, float32
      and bfloat16; 1.00-1.09 without;
    - LayerNormalization(rms_scaling=True): reduce_variance's x - mean, one float32 tensor;
    - a recurrent layer's steps (recurrent_kept_bytes; grad_in: its input gets a gradient)."""
    nbytes = (OWN_KEPT.get(kind_name, 0) * width + OWN_KEPT_BYTES.get(kind_name, 0)) * out
    if kind_name == "Attention" and op is not None:  # its softmax weights, b x Tq x Tv
        query, value = op._inbound_nodes[0].input_tensors[:2]
        nbytes += out // query.shape[-1] * value.shape[1] * width
    if kind_name == "Resizing" and half:  # _saturate_cast's clip: two bool masks
        nbytes += 2 * out
    if op is not None:
        nbytes += recurrent_kept_bytes(op, into, width, grad_in)
    if kind_name == "MultiHeadAttention" and op is not None:
        q_side, kv_side, scores = attention_sizes(op, out)
        nbytes += (q_side + kv_side) * width
        if getattr(op, "dropout", 0) > 0:  # Softmax layer, dropped scores, bool keep mask
            nbytes += scores * (2 * width + 1)
        else:  # ops.dot_product_attention: float32 softmax, softmax * scale, 16-bit cast
            nbytes += scores * (4 + 4 * scale_kept + (width if width < 4 else 0))
    if kind_name == "LayerNormalization" and getattr(op, "rms_scaling", False):
        nbytes += 4 * into  # reduce_variance's x - mean (SquaredDifference's gradient)
    if kind_name in NORMS and half:
        nbytes += 4 * into
    if kind_name == "LayerNormalization" and scaled:
        nbytes += 4 * into
    return nbytes


def kernels(op) -> list:
    """The kernels a layer reads (a convolution's, a depthwise convolution's, a Dense
    layer's), each once: none for a layer without one."""
    if type(op).__name__ == "MultiHeadAttention":  # its four EinsumDense projections'
        return [d.kernel for d in (op.query_dense, op.key_dense, op.value_dense, op.output_dense)]
    found = (getattr(op, n, None) for n in ("kernel", "depthwise_kernel", "pointwise_kernel"))
    return list({id(k): k for k in found if k is not None}.values())


def conv_kernels(op) -> tuple:
    """(depthwise kernel, dense kernel) of a convolution layer, None for what it has not: a
    DepthwiseConv2D has the first, a Conv2D the second, a SeparableConv2D both."""
    dense = isinstance(op, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D))
    depthwise = op.kernel if isinstance(op, keras.layers.DepthwiseConv2D) else None
    full = op.kernel if dense else getattr(op, "pointwise_kernel", None)
    return getattr(op, "depthwise_kernel", depthwise), full


def grouped_conv_bytes(op, xla: bool = False) -> int:
    """Keras compiles a grouped convolution with XLA even in a step that is not compiled
    (keras/src/backend/tensorflow/nn.py conv: 'grouped convolutions are broken on CPU without
    XLA'); on a CPU, XLA computes the filter gradient of one with one input channel per group
    (ConvNeXt's depthwise Conv2D) as a dense convolution and masks it: a buffer of 2 x kh x kw
    x Cin x Cout float32, whatever the batch. Measured (largest raw allocation of its
    forward+backward): 2.00x at C=768, 384, 256 and 96, kernels 3, 5 and 7, batch 4 to 16,
    float32 and bfloat16 alike. Other groupings allocated 0.1-1.8x that, with no rule found.
    In a step XLA compiles on a CPU (xla), a DepthwiseConv2D (and a SeparableConv2D's
    depthwise half) is such a convolution too: XLA's buffer assignment of keras MobileNet's
    micro-batch step (53 px, batch 1) peaks with f32[3,3,1024,1024] (the dense filter
    gradient) and f32[1024,3,3,1024] (masked) of its last depthwise layer, 72 of 107 MiB."""
    kernel = getattr(op, "kernel", None)
    groups = getattr(op, "groups", 1)
    if groups > 1 and kernel is not None and kernel.shape[-2] == 1:
        return 2 * math.prod(kernel.shape[:-2]) * groups * kernel.shape[-1] * 4
    depthwise, _ = conv_kernels(op)
    if xla and depthwise is not None:  # [kh, kw, C, multiplier]: dense [kh, kw, C, C x mult]
        kh, kw, channels, multiplier = depthwise.shape
        return 2 * kh * kw * channels * channels * multiplier * 4
    return 0


def workspace_bytes(
    op, kind_name: str, out: int, inputs: list[int], width: int, xla: bool = False
) -> int:
    """Bytes a layer's backward holds while it runs (out, inputs: elements): its output
    gradient beside the gradients of its inputs; an Add passes its output gradient on and
    allocates none, nor does an elementwise activation's (GRADIENT_IN_PLACE); a norm computes
    NORM_TEMPORARIES float32 tensors of its input's size beside its output gradient; a grouped
    convolution adds XLA's buffer, and under XLA on a CPU (xla) a depthwise one does too
    (grouped_conv_bytes). A nearest-neighbour UpSampling2D is two repeats (ops.repeat: tile
    and reshape), whose gradients are sums: the width repeat's (out / fw elements) is computed
    beside the output gradient (seen in the U-Net's allocation trace: Repeat_1/Sum, half the
    output, beside it). A global average pooling over a 16-bit map is Keras's mean, which
    casts the map to float32 before reducing it (keras/src/backend/tensorflow/numpy.py mean):
    its gradient is the float32 broadcast of the output gradient over the input's shape, cast
    back to 16 bits beside it."""
    if recurrent_shape(op) is not None:
        return recurrent_workspace_bytes(op, inputs[0], width)
    if kind_name == "TimeDistributed":  # a StridedSliceGrad of the input's size per step
        steps = op._inbound_nodes[0].input_tensors[0].shape[1] or 1
        return ((steps + 1) * inputs[0] + out) * width
    if kind_name == "MultiHeadAttention":  # the softmax gradient's two score-sized tensors
        scores = attention_sizes(op, out)[2]
        nbytes = (out + sum(inputs)) * width + 2 * scores * (width if op.dropout > 0 else 4)
    elif kind_name in NORMS:
        nbytes = out * width + NORM_TEMPORARIES * inputs[0] * 4
    elif kind_name in GRADIENT_IN_PLACE:
        nbytes = out * width
    elif kind_name == "UpSampling2D" and getattr(op, "interpolation", "") == "nearest":
        nbytes = (out + out // op.size[1]) * width
    elif kind_name == "Add":
        nbytes = out * width
    elif kind_name.startswith("GlobalAveragePooling") and width < 4:
        nbytes = out * width + inputs[0] * (4 + width)
    else:
        nbytes = (out + sum(inputs)) * width
    return nbytes + grouped_conv_bytes(op, xla)
