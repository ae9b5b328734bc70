"""Magnitude pruning in Keras 3, stepped as tensorflow-model-optimization 0.8.1 steps it.

tfmot prunes only tf_keras (Keras 2) models (tensorflow/model-optimization#1119), so it cannot
be combined with Keras 3 and our accumulation step. This module re-implements it with tfmot as
the reference; file:line below are tensorflow_model_optimization/python/core/sparsity/keras/
in 0.8.1, and tests/test_pruning_tfmot.py runs tfmot itself beside this code.

- Clock, sparsity and choice: the schedule's (runner/schedules/: tfmot's clock, its
  ConstantSparsity and PolynomialDecay, m:n groups along a kernel's input axes).
- Regrowth: tfmot assigns weight x mask to each kernel at every call, before the forward pass
  (pruning_wrapper.py:316-321; pruning_impl.py:204-254), and the optimizer then updates every
  weight, pruned ones included: at the next choice a pruned weight whose one-step update
  outgrew a kept weight comes back. Our compiled step, right after optimizer.apply, chooses the
  masks of the next step when it is a choice step (from the weights tfmot would rank), then
  multiplies each kernel by its mask, so the forward pass, evaluation and the saved model all
  see tfmot's weights. pruning.regrow=false ranks pruned weights below every kept one: a
  pruned weight stays pruned.

The masks belong to the Pruner, not to the model, so the model stays a plain Keras model:
"stripping" them is saving it as it is. Pruning does not lower training memory: the masks add
a float32 copy of every pruned kernel.
"""

import gzip
import math
import re
import sys
import tempfile
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from omegaconf import DictConfig

from runner.core.errors import ConfigError
from runner.schedules import schedule_of

# Depthwise kernels are left dense, as tfmot's prune_registry.py:62-64 does (DepthwiseConv2D:
# nothing; SeparableConv: pointwise_kernel only): a 3x3 filter per channel has few weights to
# save and each of them carries a whole channel.
_CONV = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)
# Transposed convolutions keep their kernels as (..., out_channels, in_channels).
_TRANSPOSED = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose)
_PRUNABLE = (keras.layers.Dense, keras.layers.EinsumDense, *_CONV, *_TRANSPOSED)
_KERNELS = ("kernel", "pointwise_kernel")


def _walk(layer):
    """Every sub-layer, depth first, in the order it was added (so the first conv comes first).

    Keras 3 has no public recursive traversal; non-recursive `_flatten_layers` calls keep the
    tracking order, which its recursive mode does not.
    """
    for child in layer._flatten_layers(include_self=False, recursive=False):
        yield child
        yield from _walk(child)


def _owners(model) -> dict[int, keras.layers.Layer]:
    """id(variable) -> the innermost layer that holds it (children come after their parents)."""
    return {id(v): layer for layer in _walk(model) for v in layer.trainable_weights}


def _default_kernels(model) -> list:
    """Dense, EinsumDense (MultiHeadAttention's projections) and conv kernels, except those of
    the model's first conv: it sees the raw pixels with few input channels, and pruning it
    costs accuracy for almost no weights (Zhu & Gupta 2017 leave it dense as well)."""
    layers = list(dict.fromkeys(layer for layer in _walk(model) if isinstance(layer, _PRUNABLE)))
    first_conv = next((layer for layer in layers if isinstance(layer, _CONV)), None)
    return [
        v
        for layer in layers
        if layer is not first_conv
        for v in layer.trainable_weights
        if v.name in _KERNELS
    ]


def _matches(path: str, patterns) -> bool:
    return any(re.search(pattern, path) for pattern in patterns)


def select_kernels(model, p: DictConfig) -> list:
    """The variables pruning masks, shared with the memory estimate (one mask each).

    pruning.include (regexes on variable paths such as "block_0/mlp_up/kernel"), when given,
    replaces the default selection; pruning.exclude then removes matching variables.
    Embeddings, biases, norms and depthwise kernels are not in the default selection.
    """
    if p.include:
        chosen = [v for v in model.trainable_variables if _matches(v.path, p.include)]
    else:
        chosen = _default_kernels(model)
    return [v for v in chosen if not _matches(v.path, p.exclude)]


def input_axes(layer, rank: int) -> tuple[int, ...]:
    """The kernel axes its layer sums the input over: where m:n hardware groups weights
    (tfmot's weights_rearrange: Dense (in, out) along in, Conv2D along in_channels)."""
    if isinstance(layer, keras.layers.EinsumDense):
        inputs, rest = layer.equation.split(",")
        kernel = rest.split("->")[0]  # e.g. attention output "abcd,cde->abe": c and d
        return tuple(i for i, letter in enumerate(kernel) if letter in inputs)
    if isinstance(layer, _TRANSPOSED):
        return (rank - 1,)
    if isinstance(layer, _CONV):
        return (rank - 2,)  # Keras conv kernels: (*window, in_channels, out_channels)
    return (0,)  # Dense (in, out), and any variable chosen by pruning.include


class Pruner:
    """One float32 mask per selected kernel, chosen and applied by `after_update`, which the
    compiled step runs right after each optimizer update (runner/techniques/accumulation.py)."""

    def __init__(self, model, p: DictConfig, total_steps: int, optimizer):
        self.schedule = schedule_of(p)
        self.schedule.check_steps(total_steps)
        self.model, self.cfg, self.total_steps = model, p, total_steps
        self.optimizer = optimizer  # its iterations are the clock (a LossScaleOptimizer's: inner)
        self.kernels = select_kernels(model, p)
        if not self.kernels:
            key = "include" if p.include else "exclude"
            value = list(p[key])
            raise ConfigError(f"pruning.{key}", value, "patterns that leave a variable to prune")
        owners = _owners(model)
        self.axes = [input_axes(owners.get(id(v)), len(v.shape)) for v in self.kernels]
        self.masks = [
            tf.Variable(tf.ones(v.shape, tf.float32), trainable=False, name=f"mask/{v.path}")
            for v in self.kernels
        ]
        self.dense_gzip_bytes = gzip_weights_bytes(model)  # as built, before any pruning

    def after_update(self, grads=None, variables=None) -> None:
        """If the next step is a choice step, choose its masks from the updated weights; then
        kernel <- kernel x mask. Run eagerly, or traced into the compiled step (which passes
        the step's gradients, not read here)."""
        step = tf.convert_to_tensor(self.optimizer.iterations) + 1  # the next step, from 1
        due = self.schedule.is_update_step(step, self.total_steps)
        tf.cond(due, lambda: self._choose_masks(step), lambda: None)
        for kernel, mask in zip(self.kernels, self.masks, strict=True):
            kernel.assign(kernel.value * tf.cast(mask, kernel.dtype))

    def _choose_masks(self, step) -> None:
        schedule = self.schedule
        sparsity = schedule.sparsity(step, self.total_steps)
        for kernel, mask, axes in zip(self.kernels, self.masks, self.axes, strict=True):
            scores = tf.abs(tf.cast(kernel.value, tf.float32))
            if not schedule.regrow:
                scores = tf.where(mask > 0, scores, -1.0)
            mask.assign(schedule.choose(scores, sparsity, axes))

    @property
    def updates(self) -> list[tuple[int, float]]:
        """(step, scheduled sparsity) of each choice so far: masks for step t are chosen once
        optimizer.iterations reaches t - 1."""
        done = int(keras.ops.convert_to_numpy(self.optimizer.iterations))  # mirrored too
        schedule, total = self.schedule, self.total_steps
        steps = [t for t in range(2, done + 2) if schedule.is_update_step(t, total)]
        return [(t, float(schedule.sparsity(t, total))) for t in steps]

    def mask_bytes(self) -> int:
        return sum(4 * math.prod(v.shape) for v in self.kernels)

    def table(self) -> list[dict]:
        """Per pruned kernel: path, shape, size, zeros, achieved sparsity."""
        rows = []
        for v in self.kernels:
            weights = keras.ops.convert_to_numpy(v)
            size, zeros = weights.size, int(np.count_nonzero(weights == 0))
            shape = "x".join(str(d) for d in weights.shape)
            row = dict(path=v.path, shape=shape, size=size, zeros=zeros, sparsity=zeros / size)
            rows.append(row)
        return rows


def gzip_weights_bytes(model) -> int:
    """gzip-compressed size of the model's weights file (model.save_weights, .weights.h5): what
    pruning saves on disk or over the wire, since the file itself stores the zeros densely."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.weights.h5"
        model.save_weights(path)
        return len(gzip.compress(path.read_bytes(), compresslevel=9))


def build_pruner(model, p: DictConfig, total_steps: int, optimizer) -> Pruner | None:
    """A Pruner of cfg.pruning `p` for `model` as built (checkpointing's wrapper shares its
    variables), stepped by `optimizer`'s iterations; None without pruning."""
    if p.schedule == "none":
        return None
    pruner = Pruner(model, p, total_steps, optimizer)
    print(
        f"note: pruning={p.schedule} does not lower training memory: the dense "
        f"weights, gradients and optimizer slots all stay, and the masks add a float32 copy of "
        f"each of the {len(pruner.kernels)} pruned kernels ({pruner.mask_bytes() / 2**20:.2f} "
        "MiB, mem/estimate/masks_bytes). It shrinks the compressed weights (prune/gzip_ratio).",
        file=sys.stderr,
    )
    return pruner
