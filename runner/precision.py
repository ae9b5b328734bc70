"""Mixed precision: the Keras dtype policy for the run, and loss scaling for float16."""

import contextlib
import sys

import keras
from omegaconf import DictConfig

# What the choice does on a CPU, said once per run (shared GUIDE, "Precision on this CPU";
# tensorflow/tensorflow#45441 measured fp16 3 s -> 187 s per epoch without XLA).
_CPU_NOTES = {
    "mixed_float16": "precision=mixed on a CPU: float16 math is emulated and very slow without "
    "XLA; under XLA it is computed in float32, so it saves little or no memory. Its memory "
    "gain is a GPU figure.",
    "mixed_bfloat16": "precision=bf16 on a CPU without native bfloat16 (AVX512_BF16/AMX): slower "
    "without XLA and, under XLA, computed in float32, so it saves little memory. Its memory "
    "gain is a GPU/TPU figure.",
}


@contextlib.contextmanager
def policy(cfg: DictConfig, on_gpu: bool):
    """Set the global dtype policy for the run and restore the previous one after it."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(cfg.precision.policy)
    if not on_gpu and cfg.precision.policy in _CPU_NOTES:
        print(f"note: {_CPU_NOTES[cfg.precision.policy]}", file=sys.stderr)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def wrap_optimizer(optimizer: keras.optimizers.Optimizer, cfg: DictConfig):
    """Dynamic loss scaling for float16: Keras's LossScaleOptimizer (skips non-finite steps)."""
    if not cfg.precision.loss_scaling:
        return optimizer
    return keras.optimizers.LossScaleOptimizer(
        optimizer,
        initial_scale=cfg.precision.initial_scale,
        dynamic_growth_steps=cfg.precision.dynamic_growth_steps,
    )
