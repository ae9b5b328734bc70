"""What a layer's kernels cost the backward walk (runner/estimate/graph_walk.py) beside its
activations: the 16-bit casts a step makes of them, and in a step XLA compiles on a CPU the
float32 copies and transposes it keeps instead; and a layer's 16-bit cast of a model input."""

import math

from runner.estimate import layer_rules


def kernel_elements(op) -> int:
    """Elements of the kernels a layer reads in its compute dtype (a convolution's, a
    depthwise convolution's, a Dense layer's), whose casts its input gradient reads."""
    return sum(math.prod(k.shape) for k in layer_rules.kernels(op))


def convolves(op) -> bool:
    return any(k is not None for k in layer_rules.conv_kernels(op))


def xla_kernel_bytes(op, grad_in: bool) -> int:
    """Bytes of a convolution's kernels that a step XLA compiles on a CPU copies when it starts
    and keeps until the layer's backward, in place of the executor's 16-bit casts: each kernel
    as float32 under a 16-bit policy (XLA on a CPU convolves in float32: the cast is rounded
    and converted back), and each dense (not depthwise) kernel's float32 transpose, which its
    input gradient's convolution reads (none where that gradient is not computed: grad_in
    false, a layer reading the model's input). A Dense kernel keeps its 16-bit cast (the
    walk's). Read off XLA's scheduled
    buffer assignments: EfficientNetV2B2's step (bfloat16, 55 px, batch 4) computes 96
    kernel transposes and its float32 conversions before its first convolution, all read
    in the backward pass and alive at its peak (29.9 MiB of transposes, 26.2 of
    conversions, no bfloat16 kernel); keras MobileNet's (float32) held the transposes of its
    1x1 kernels whose backward had not run (9.0 MiB); a depthwise kernel [kh, kw, C, 1] is
    read as [kh, kw, 1, C], the same bytes in float32 (a copy in 16 bits)."""
    depthwise, full = layer_rules.conv_kernels(op)
    # The estimate's width under XLA on a CPU is float32's or more: the layer's own dtype says
    # whether its kernel is cast to 16 bits.
    converted = getattr(op, "compute_dtype", "float32") in ("bfloat16", "float16")
    elements = math.prod(depthwise.shape) if depthwise is not None and converted else 0
    if full is not None:
        elements += math.prod(full.shape) * (int(converted) + int(grad_in))
    return elements * 4


def input_cast_bytes(op, inputs: list[int], model_input: list[bool], width: int) -> int:
    """Bytes of a layer's 16-bit cast of a float32 model input (inputs: its inputs' elements;
    model_input: which are the model's), where its backward reads its input (a kernel's
    gradient): Keras casts a layer's floating inputs to its compute dtype as it calls it
    (keras/src/layers/layer.py Layer.__call__, maybe_convert), a new tensor made in the step,
    which that backward keeps; float32's input is the batch itself. Seen in the allocation
    trace of a ViT's step under bfloat16 (its patches' Conv2D on 28x28x3 images, b 52:
    vit/Cast, 0.233 MiB, alive at the peak)."""
    if width == 4 or layer_rules.kind(op) not in layer_rules.input_keepers(half=True):
        return 0
    tensors = op._inbound_nodes[0].input_tensors if getattr(op, "_inbound_nodes", None) else []
    return sum(
        n * width
        for n, made, k in zip(inputs, model_input, tensors, strict=False)
        if made and str(k.dtype) == "float32"
    )
