"""FLOPs per optimizer step (model and hardware, recomputation included), the device's peak
FLOP/s and MFU, logged beside the measured step time."""

import math
import re

import keras
import tensorflow as tf

from runner.estimate import layer_rules
from runner.measure import cpu_peak
from runner.techniques.checkpointing import RematInfo

# Dense (no sparsity) peaks from the vendors' data sheets, FLOP/s: (float32 on CUDA cores,
# TF32 on tensor cores or None where the chip has none, 16-bit on tensor cores).
# Word-bounded names, so "A10" does not match "A100" nor "L4" "L40S".
GPU_PEAKS = {
    "H100": (67e12, 494.7e12, 989e12),
    "H200": (67e12, 494.7e12, 989e12),
    "A100": (19.5e12, 156e12, 312e12),
    "V100": (15.7e12, None, 125e12),
    "L4": (30.3e12, 60e12, 121e12),
    "T4": (8.1e12, None, 65e12),
    "A10": (31.2e12, 62.5e12, 125e12),
}


def _non_embedding_params(model) -> int:
    embedding = {
        id(v)
        for layer in model.layers
        if isinstance(layer, keras.layers.Embedding)
        for v in layer.weights
    }
    return sum(math.prod(v.shape) for v in model.weights if id(v) not in embedding)


def kernel_macs(model, names: set[str] | None = None) -> int:
    """Multiply-accumulates of one example's forward pass from layer shapes (channels last),
    over all layers or those named in `names`.

    A Dense or Conv kernel is applied once per output position: kernel size x output positions
    (Conv2D: kh*kw*cin*cout x oh*ow; DepthwiseConv2D: kh*kw*cin*mult x oh*ow; Dense: in*out).
    """
    total = 0
    for layer in model.layers:
        if names is not None and layer.name not in names:
            continue
        for name in ("kernel", "depthwise_kernel"):
            kernel = getattr(layer, name, None)
            if isinstance(kernel, keras.Variable):
                total += math.prod(kernel.shape) * math.prod(layer.output.shape[1:-1])
    return total


def graph_forward_flops(model, spec) -> float:
    """Forward FLOPs of one example, counted by the TensorFlow profiler on the traced graph.

    The profiler counts 2 per multiply-accumulate plus bias adds and other elementwise ops with
    registered statistics. If it counts nothing (ops without statistics), fall back to
    2 x Dense/Conv MACs from the layer shapes, which misses only the elementwise ops.
    """
    concrete = tf.function(model).get_concrete_function(
        tf.TensorSpec([1, *spec.input_shape], tf.float32)
    )
    builder = tf.compat.v1.profiler.ProfileOptionBuilder
    options = builder(builder.float_operation()).with_empty_output().build()
    flops = tf.compat.v1.profiler.profile(graph=concrete.graph, options=options).total_float_ops
    return float(flops or 2 * kernel_macs(model))


def model_flops_per_step(model, cfg, spec) -> float:
    """FLOPs of one optimizer step: cfg.accum micro-batches of cfg.data.batch_size examples."""
    examples = cfg.data.batch_size * cfg.accum
    if cfg.model.name == "transformer":
        # PaLM (Chowdhery et al. 2022), appendix B: 6N + 12*L*H*Q*T FLOPs per token, N the
        # non-embedding parameters, H*Q = h, T = s; the second term is attention's QK^T and AV.
        m, s = cfg.model, spec.seq_len
        per_token = 6 * _non_embedding_params(model) + 12 * m.layers * m.h * s
        return float(per_token * examples * s)
    # Backward costs ~2x forward (input and weight gradients), so training is 3x forward.
    return 3.0 * graph_forward_flops(model, spec) * examples


def hardware_flops_per_step(model_flops: float, model, cfg, spec, remat: RematInfo) -> float:
    """Model FLOPs plus the forward passes that checkpointing runs again in backprop.

    Transformer: every block is recomputed once, 2*12h^2 + 4hs FLOPs per token per layer
    (the forward third of PaLM's 6N + 12Lhs); selective: the attention core's 4hs. CNNs: the
    recomputed segments' share of the forward MACs (from layer shapes) applied to the forward
    FLOPs (a third of model FLOPs); selective: the recomputed layers' FLOPs as
    runner/estimate/layer_rules.py counts them.
    """
    if not remat.segments:
        return model_flops
    examples = cfg.data.batch_size * cfg.accum
    if cfg.model.name == "transformer":
        m, s = cfg.model, spec.seq_len
        if remat.policy == "selective":  # the attention core: scores and product with V
            return model_flops + float(examples * s * m.layers * 4 * m.h * s)
        return model_flops + float(examples * s * m.layers * (24 * m.h**2 + 4 * m.h * s))
    if remat.policy == "selective":
        return model_flops + recomputed_flops(model, remat) * examples
    share = kernel_macs(model, set().union(*remat.segment_ops)) / kernel_macs(model)
    return model_flops * (1 + share / 3)


def recomputed_flops(model, remat: RematInfo) -> float:
    """Forward FLOPs per example that checkpointing runs again in backprop, by the rules of
    runner/estimate/layer_rules.py (selective on a CNN: its runs of cheap layers)."""
    inside = set().union(*remat.segment_ops) if remat.segments else set()
    return sum(layer_rules.layer_flops(op) for op in model.operations if op.name in inside)


def peak_flops(
    device_name: str, policy: str, cache_dir, tf32: bool = False, achieved: float = math.nan
) -> tuple[float, str]:
    """(peak FLOP/s, where it came from) for `device_name` under the precision `policy`.

    On a CPU, a matmul calibration cached in cache_dir: the faster of float32 and the policy's
    16-bit dtype, redone when `achieved` (the run's FLOP/s, recomputation included) exceeds
    it. On a GPU with TF32 tensor cores (Ampere and later), float32 matmuls run as TF32 while
    TensorFlow's TensorFloat-32 execution is on (its default), so `tf32` makes that rate the
    peak; without it, float32 MFU there would be measured against a rate the matmuls are not
    bound by.
    """
    if device_name.startswith("/CPU") or "CPU" in device_name.upper():
        return cpu_peak.peak(cache_dir, policy, achieved)
    for model, (fp32, tf32_peak, half) in GPU_PEAKS.items():
        if re.search(rf"\b{model}\b", device_name.upper()):
            if policy != "float32":
                return half, f"table:{model}"
            if tf32 and tf32_peak:
                return tf32_peak, f"table:{model}:tf32"
            return fp32, f"table:{model}"
    return math.nan, "unknown"


def _positive(*values) -> list[float] | None:
    """`values` as floats if all are finite and positive, else None."""
    try:
        floats = [float(v) for v in values]
    except (TypeError, ValueError):
        return None
    return floats if all(math.isfinite(v) and v > 0 for v in floats) else None


def achieved_flops(flops_per_step: float, step_time_s: float) -> float:
    """FLOP/s a run achieved; nan when any input is unusable."""
    values = _positive(flops_per_step, step_time_s)
    return values[0] / values[1] if values else math.nan


def mfu(flops_per_step: float, step_time_s: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over peak; nan when any input is unusable."""
    values = _positive(flops_per_step, step_time_s, peak)
    return values[0] / values[1] / values[2] if values else math.nan
