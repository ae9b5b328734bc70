"""Magnitude pruning in Keras 3, stepped as tensorflow-model-optimization 0.8.1 steps it.

tfmot prunes only tf_keras (Keras 2) models (tensorflow/model-optimization#1119), so it cannot
be combined with Keras 3 and our accumulation step. This module re-implements it with tfmot as
the reference; file:line below are tensorflow_model_optimization/python/core/sparsity/keras/
in 0.8.1, and tests/test_pruning_tfmot.py runs tfmot itself beside this code.

- Clock: step t is the t-th optimizer step, from 1, i.e. `optimizer.iterations + 1` as it
  starts; the LR schedule reads the same counter. tfmot's wrapper adds 1 to its pruning_step
  (set to 0 by UpdatePruningStep.on_train_begin, pruning_callbacks.py:54-65) at the start of
  every training call, then runs conditional_mask_update with it (pruning_wrapper.py:289-314):
  its step t is ours. A float16 step skipped for overflow advances neither of our clocks.
- When: masks are chosen at the start of step t if begin_step <= t <= end_step and
  (t - begin_step) % frequency == 0 (_should_prune_in_step, pruning_schedule.py:40-64), so with
  begin_step 0 the first choice is at step `frequency`, after frequency - 1 trained steps. Ours
  adds end_step itself, so polynomial ends on target_sparsity when end_step - begin_step is not
  a multiple of frequency (tfmot stops short). config.py refuses a first choice at step 1: it
  would rank the initial weights, i.e. prune at random.
- What: a kernel keeps its max(round(size x (1 - s)), 1) largest |w|, at least one weight
  (_update_mask, pruning_impl.py:91-100, float32 as there); tfmot also keeps every |w| tied
  with the last one kept, we keep exactly that many. m_by_n keeps the m largest of every n along
  the input axis (pruning_utils.py:193-330); tfmot chooses those once, at step 1 (pruning_impl.py:
  260-262), on untrained weights: here they follow begin_step and frequency like the others.
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

from runner.config.validate import check_pruning_steps
from runner.core.errors import ConfigError

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


def _end(p, total_steps: int) -> int:
    return total_steps if p.end_step is None else p.end_step


def is_update_step(p, step, total_steps: int):
    """Are masks chosen at the start of step `step` (from 1)? For a Python int or an int64
    tensor (the compiled step asks with optimizer.iterations + 1)."""
    if p.schedule == "none":
        return False
    begin, end = p.begin_step, _end(p, total_steps)
    on_grid = (step - begin) % p.frequency == 0
    return (step >= begin) & (step <= end) & (on_grid | (step == end))


def scheduled_sparsity(p, step, total_steps: int) -> tf.Tensor:
    """The schedule's sparsity at step `step`, in float32 op for op as tfmot computes it
    (ConstantSparsity, PolynomialDecay.__call__: pruning_schedule.py:163-166, 222-246)."""
    if p.schedule == "m_by_n":
        return tf.constant(1.0 - p.m / p.n, tf.float32)
    if p.schedule == "constant":
        return tf.constant(p.target_sparsity, tf.float32)
    begin, end = p.begin_step, _end(p, total_steps)
    if end == begin:  # tfmot would divide by zero
        return tf.constant(p.target_sparsity, tf.float32)
    # Zhu & Gupta 2017, eq. (1): s_t = s_f + (s_i - s_f)(1 - (t - t0) / (n dt))^power.
    done = tf.minimum(1.0, tf.maximum(0.0, tf.cast(step - begin, tf.float32) / (end - begin)))
    decay = (p.initial_sparsity - p.target_sparsity) * tf.pow(1 - done, p.power)
    return decay + p.target_sparsity


def sparsity_at(p, step: int, total_steps: int) -> float:
    """The sparsity the masks hold during step `step`: the schedule's value at the last choice
    at or before it (0 before the first)."""
    chosen = [t for t in range(2, step + 1) if is_update_step(p, t, total_steps)]
    return float(scheduled_sparsity(p, chosen[-1], total_steps)) if chosen else 0.0


def magnitude_mask(scores: tf.Tensor, sparsity: tf.Tensor) -> tf.Tensor:
    """1 for the max(round(size x (1 - sparsity)), 1) largest scores (|w|), 0 elsewhere."""
    flat = tf.reshape(scores, [-1])
    size = flat.shape[0]
    kept = tf.maximum(tf.round(tf.cast(size, tf.float32) * (1 - sparsity)), 1)
    _, order = tf.math.top_k(flat, k=size)  # descending; ties: lower index first, as tfmot
    keep = tf.cast(tf.range(size) < tf.cast(kept, tf.int32), tf.float32)
    return tf.reshape(tf.scatter_nd(order[:, None], keep, [size]), scores.shape)


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


def m_by_n_mask(scores: tf.Tensor, axes: tuple[int, ...], m: int, n: int) -> tf.Tensor:
    """Keep the m largest scores in every n consecutive ones along `axes` (flattened in order).

    Like tfmot's generate_m_by_n_mask, a last shorter group is padded; the pads rank below
    every real score, so it keeps its m largest too. (tfmot's m counts zeros; here m counts
    the weights kept, as in NVIDIA's "2:4". Both mean the same for 2:4.)
    """
    perm = [a for a in range(len(scores.shape)) if a not in axes] + list(axes)
    moved = tf.transpose(scores, perm)
    length = math.prod(scores.shape[a] for a in axes)
    rows = tf.reshape(moved, [-1, length])
    padded = tf.pad(rows, [[0, 0], [0, -length % n]], constant_values=-np.inf)
    _, keep = tf.math.top_k(tf.reshape(padded, [-1, n]), k=m)  # ties: lower index first
    groups = tf.reduce_sum(tf.one_hot(keep, n, dtype=tf.float32), axis=1)
    mask = tf.reshape(groups, tf.shape(padded))[:, :length]
    return tf.transpose(tf.reshape(mask, moved.shape), np.argsort(perm))


class Pruner:
    """One float32 mask per selected kernel, chosen and applied by `after_update`, which the
    compiled step runs right after each optimizer update (runner/techniques/accumulation.py)."""

    def __init__(self, model, p: DictConfig, total_steps: int, optimizer):
        check_pruning_steps(p, total_steps)
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

    def after_update(self) -> None:
        """If the next step is a choice step, choose its masks from the updated weights; then
        kernel <- kernel x mask. Run eagerly, or traced into the compiled step."""
        step = tf.convert_to_tensor(self.optimizer.iterations) + 1  # the next step, from 1
        due = is_update_step(self.cfg, step, self.total_steps)
        tf.cond(due, lambda: self._choose_masks(step), lambda: None)
        for kernel, mask in zip(self.kernels, self.masks, strict=True):
            kernel.assign(kernel.value * tf.cast(mask, kernel.dtype))

    def _choose_masks(self, step) -> None:
        p = self.cfg
        sparsity = scheduled_sparsity(p, step, self.total_steps)
        for kernel, mask, axes in zip(self.kernels, self.masks, self.axes, strict=True):
            scores = tf.abs(tf.cast(kernel.value, tf.float32))
            if not p.regrow:
                scores = tf.where(mask > 0, scores, -1.0)
            if p.schedule == "m_by_n":
                mask.assign(m_by_n_mask(scores, axes, p.m, p.n))
            else:
                mask.assign(magnitude_mask(scores, sparsity))

    @property
    def updates(self) -> list[tuple[int, float]]:
        """(step, scheduled sparsity) of each choice so far: masks for step t are chosen once
        optimizer.iterations reaches t - 1."""
        done = int(keras.ops.convert_to_numpy(self.optimizer.iterations))  # mirrored too
        p, total = self.cfg, self.total_steps
        steps = [t for t in range(2, done + 2) if is_update_step(p, t, total)]
        return [(t, float(scheduled_sparsity(p, t, total))) for t in steps]

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
