"""The optimizer and its learning rate, the evaluation step, and whether XLA compiles the steps.

The train step itself, with gradient accumulation, is runner/techniques/accumulation.py.
"""

import keras
import tensorflow as tf


def resolve_jit(flag: str, model_name: str, on_gpu: bool) -> bool:
    """trainer.jit_compile=auto: XLA on GPUs, and on CPUs for the transformer only.

    Measured on a 2-core CPU: XLA made the transformer ~2.7x faster per step (docs/findings.md),
    but MobileNetV2 (alpha 0.35, 32x32, batch 32) 6x slower (0.30 s vs 0.05 s per step) and
    twice as slow to compile; Keras's own "auto" leaves XLA off on every CPU.
    """
    flag = str(flag).lower()
    if flag == "auto":
        return on_gpu or model_name == "transformer"
    return flag == "true"


def make_eval_step(model, loss_fn, jit_compile: bool):
    """Summed loss, correct predictions and target count of one validation batch."""

    @tf.function(jit_compile=jit_compile)
    def eval_step(x, y):
        logits = model(x, training=False)
        count = tf.cast(tf.size(y), tf.float32)
        correct = tf.cast(tf.argmax(logits, axis=-1, output_type=y.dtype) == y, tf.float32)
        return loss_fn(y, logits) * count, tf.reduce_sum(correct), count

    return eval_step


def learning_rate(t, total_steps: int):
    """trainer.lr (t: cfg.trainer), constant or cosine-decayed over the run's optimizer steps.

    The optimizer's iteration counter advances once per optimizer step (one apply per call of
    the train step), so schedules count optimizer steps, not micro-batches.
    """
    if t.schedule == "constant":
        return t.lr
    warmup = min(t.warmup_steps, total_steps - 1)
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup else t.lr,
        decay_steps=max(total_steps - warmup, 1),
        warmup_target=t.lr if warmup else None,
        warmup_steps=warmup,
    )


def build_optimizer(t, total_steps: int = 1) -> keras.optimizers.Optimizer:
    """cfg.trainer `t`'s optimizer, its learning rate scheduled over total_steps."""
    lr = learning_rate(t, total_steps)
    if t.optimizer == "adam":
        return keras.optimizers.Adam(lr)
    if t.optimizer == "adamw":
        return keras.optimizers.AdamW(lr, weight_decay=t.weight_decay)
    return keras.optimizers.SGD(lr, momentum=t.momentum)
