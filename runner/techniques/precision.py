"""Mixed precision: the Keras dtype policy for the run, and loss scaling for float16."""

import contextlib

import keras
from omegaconf import DictConfig

from runner.core.machine import cpu_kernels

# `python -m runner.bench precision_accum` (one process per job, 2-core CPUs, the allocator's
# pool grown first), ratios to fp32 at batch 8: MobileNetV2 96x96 without XLA, the transformer
# (h=128, 4 layers) under XLA. By the CPU's kernels: with AVX512_BF16/AMX TensorFlow runs
# oneDNN's (a Xeon, one run each); without AVX512, its own (an AMD EPYC, medians of 3
# interleaved rounds, 2026-12-04). With AVX512F alone oneDNN emulates bfloat16 (a Xeon,
# `python -m runner.bench plan --time` and `checkpointing --repeats 3`, 2026-12-04); its
# float16 runs TensorFlow's own kernels, as without AVX512.
_MEASURED = {
    "with AVX512_BF16/AMX": {
        "mixed": "saved 23% of MobileNetV2's peak but ran 25x slower per step; under XLA (the "
        "transformer) its float32 copies raised the peak 1.23-1.26x",
        "bf16": "saved 24% of MobileNetV2's peak at 1.26x the step time; under XLA (the "
        "transformer) it is computed largely in float32 (0.94-0.97x the float32 peak)",
    },
    "with AVX512F alone": {
        "bf16": "took 1.03x fp32's step time on MobileNetV2 (within noise), and the "
        "transformer (dropout 0) peaked at 0.83x at 1.92x the time; under XLA (the "
        "transformer) it took 1.06x the time",
    },
    "without AVX512": {
        "mixed": "saved 13% of MobileNetV2's peak at 2.0x the step time; under XLA (the "
        "transformer) its float32 copies raised the peak 1.35x, at 1.28x the time (within noise)",
        "bf16": "saved 18% of MobileNetV2's peak at 4.4x the step time; under XLA (the "
        "transformer) it is computed largely in float32 (1.03x the float32 peak, 1.11x the "
        "time)",
    },
}


def cpu_note(policy: str) -> str | None:
    """What a 16-bit policy will do on a CPU, said once per run, in figures measured on a CPU
    of this one's kind (_MEASURED); tensorflow/tensorflow#45441 measured fp16 3 s -> 187 s per
    epoch without XLA."""
    kind = "mixed" if policy == "mixed_float16" else "bf16" if policy == "mixed_bfloat16" else None
    if kind is None:
        return None
    cpu = {
        "onednn": "with AVX512_BF16/AMX",
        "onednn_emulated": "with AVX512F alone",
        "tensorflow": "without AVX512",
    }[cpu_kernels(kind)]
    head = ": float16 is emulated" if kind == "mixed" else ""
    gain = "a GPU figure" if kind == "mixed" else "a GPU/TPU figure"
    return (
        f"precision={kind} on a CPU{head}. Measured on a CPU {cpu} (whose kernels this one "
        f"runs), without XLA it {_MEASURED[cpu][kind]}. Its memory gain is {gain}."
    )


def note(p: DictConfig, dev: str) -> str | None:
    """What the run's precision (cfg.precision) does on this device, when a CPU changes the
    story."""
    return None if dev.startswith("/GPU") else cpu_note(p.policy)


@contextlib.contextmanager
def policy(p: DictConfig):
    """Set the global dtype policy of the run's precision (cfg.precision) and restore the
    previous one after it."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(p.policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def wrap_optimizer(optimizer: keras.optimizers.Optimizer, p: DictConfig):
    """Dynamic loss scaling for float16 (cfg.precision.loss_scaling): Keras's
    LossScaleOptimizer, which skips non-finite steps."""
    if not p.loss_scaling:
        return optimizer
    return keras.optimizers.LossScaleOptimizer(
        optimizer, initial_scale=p.initial_scale, dynamic_growth_steps=p.dynamic_growth_steps
    )


def step_metrics(optimizer):
    """Per-step `precision/loss_scale` for a loss-scaled optimizer, else None."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    return lambda: {"precision/loss_scale": float(optimizer.dynamic_scale.numpy())}
