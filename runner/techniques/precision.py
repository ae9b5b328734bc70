"""Mixed precision: the Keras dtype policy for the run, and loss scaling for float16."""

import contextlib

import keras
from omegaconf import DictConfig

from runner.core.machine import cpu_has_bf16


def cpu_note(policy: str) -> str | None:
    """What a 16-bit policy will do on a CPU, said once per run: tensorflow/tensorflow#45441
    measured fp16 3 s -> 187 s per epoch without XLA; `python -m runner.bench precision_accum`
    (one process per job, 2-core CPU, allocator pool grown first) measured the peaks and step
    times quoted here; the transformer's ranges span its batch 8 and 32 jobs and the
    `memory` bench."""
    if policy == "mixed_float16":
        return (
            "precision=mixed on a CPU: float16 is emulated. Without XLA (CNNs) it saved 23% "
            "of MobileNetV2's peak but ran 25x slower per step; under XLA (the transformer) "
            "its float32 copies raised the peak 1.23-1.26x. Its memory gain is a GPU figure."
        )
    if policy == "mixed_bfloat16":
        native = "has" if cpu_has_bf16() else "lacks"
        return (
            f"precision=bf16 on a CPU (this one {native} AVX512_BF16/AMX): without XLA it "
            "saved 24% of MobileNetV2's peak at 1.26x the step time; under XLA it is computed "
            "largely in float32 (0.94-0.97x the float32 peak). Its memory gain is a GPU/TPU "
            "figure."
        )
    return None


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
