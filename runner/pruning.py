"""Magnitude pruning in Keras 3: float32 masks beside the kernels, applied after every update.

tensorflow-model-optimization prunes only tf_keras (Keras 2) models
(tensorflow/model-optimization#1119), so it cannot be combined with Keras 3 and our
accumulation step. This module re-implements what it does, with tfmot as the reference:
its schedules (pruning_schedule.py: ConstantSparsity; PolynomialDecay, which is Zhu & Gupta
2017, https://arxiv.org/abs/1710.01878), its magnitude masks (pruning_impl.py) and its m-by-n
masks (pruning_utils.py).

Steps are optimizer steps completed (`optimizer.iterations`, tfmot's pruning step): the mask
update "at step t" runs in the Python loop just before optimizer step t + 1, and the compiled
step multiplies each kernel by its mask right after `optimizer.apply`, so pruned weights stay
exactly zero whatever the optimizer's momentum does. The masks belong to the Pruner, not to
the model, so the model stays a plain Keras model: "stripping" them is saving it as it is.
Pruning does not lower training memory: the masks add a float32 copy of every pruned kernel.
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

from runner.config import ConfigError, check_pruning_steps

_CONV = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)
# Transposed convolutions keep their kernels as (..., out_channels, in_channels).
_TRANSPOSED = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose)
_PRUNABLE = (keras.layers.Dense, keras.layers.EinsumDense, *_CONV, *_TRANSPOSED)


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
        if v.name.endswith("kernel")  # kernel, depthwise_kernel, pointwise_kernel
    ]


def _matches(path: str, patterns) -> bool:
    return any(re.search(pattern, path) for pattern in patterns)


def select_kernels(model, cfg: DictConfig) -> list:
    """The variables pruning masks, shared with the memory estimate (one mask each).

    pruning.include (regexes on variable paths such as "block_0/mlp_up/kernel"), when given,
    replaces the default selection; pruning.exclude then removes matching variables.
    Embeddings, biases and norms are not in the default selection.
    """
    p = cfg.pruning
    if p.include:
        chosen = [v for v in model.trainable_variables if _matches(v.path, p.include)]
    else:
        chosen = _default_kernels(model)
    return [v for v in chosen if not _matches(v.path, p.exclude)]


def _last_step(p, total_steps: int) -> int:
    return total_steps - 1 if p.end_step is None else p.end_step


def is_update_step(p, step: int, total_steps: int) -> bool:
    """Masks are recomputed at begin_step + k * frequency up to end_step, as in tfmot, and at
    end_step itself, so the schedule ends on target_sparsity even when end_step - begin_step is
    not a multiple of frequency (tfmot then stops short of it)."""
    end = _last_step(p, total_steps)
    if p.schedule == "none" or not p.begin_step <= step <= end:
        return False
    return (step - p.begin_step) % p.frequency == 0 or step == end


def sparsity_at(p, step: int, total_steps: int) -> float:
    """The sparsity the masks hold during optimizer step step + 1: the schedule's value at the
    last mask update at or before `step` (0 before begin_step)."""
    if p.schedule == "none" or step < p.begin_step:
        return 0.0
    if p.schedule == "m_by_n":
        return 1.0 - p.m / p.n
    if p.schedule == "constant":
        return p.target_sparsity
    begin, end = p.begin_step, _last_step(p, total_steps)
    last = end if step >= end else begin + (step - begin) // p.frequency * p.frequency
    done = (last - begin) / (end - begin) if end > begin else 1.0
    # Zhu & Gupta 2017, eq. (1): s_t = s_f + (s_i - s_f)(1 - (t - t0) / (n dt))^3.
    return p.target_sparsity + (p.initial_sparsity - p.target_sparsity) * (1.0 - done) ** 3


def magnitude_mask(weights: np.ndarray, sparsity: float) -> np.ndarray:
    """Zero exactly round(sparsity x size) of the smallest |w|. (tfmot keeps every |w| at or
    above a threshold, so ties can leave it a few zeros short.)"""
    flat = np.abs(weights).ravel()
    zeros = round(sparsity * flat.size)
    mask = np.ones(flat.size, np.float32)
    if zeros:
        mask[np.argpartition(flat, zeros - 1)[:zeros]] = 0.0
    return mask.reshape(weights.shape)


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


def m_by_n_mask(weights: np.ndarray, axes: tuple[int, ...], m: int, n: int) -> np.ndarray:
    """Keep the m largest |w| in every n consecutive weights along `axes` (flattened in order).

    Like tfmot's generate_m_by_n_mask, a last shorter group is padded; the pads rank below
    every real weight, so it keeps its m largest too. (tfmot's m counts zeros; here m counts
    the weights kept, as in NVIDIA's "2:4". Both mean the same for 2:4.)
    """
    perm = [a for a in range(weights.ndim) if a not in axes] + list(axes)
    moved = np.abs(np.transpose(weights, perm))
    rows = moved.reshape(-1, math.prod(weights.shape[a] for a in axes))
    padded = np.pad(rows, ((0, 0), (0, -rows.shape[1] % n)), constant_values=-1.0)
    groups = padded.reshape(-1, n)
    keep = np.argsort(-groups, axis=1, kind="stable")[:, :m]
    mask = np.zeros(groups.shape, np.float32)
    np.put_along_axis(mask, keep, 1.0, axis=1)
    mask = mask.reshape(padded.shape)[:, : rows.shape[1]].reshape(moved.shape)
    return np.transpose(mask, np.argsort(perm))


class Pruner:
    """One float32 mask per selected kernel; update_masks between steps, apply_masks in them."""

    def __init__(self, model, cfg: DictConfig, total_steps: int):
        check_pruning_steps(cfg.pruning, total_steps)
        self.model, self.cfg, self.total_steps = model, cfg.pruning, total_steps
        self.kernels = select_kernels(model, cfg)
        if not self.kernels:
            key = "include" if cfg.pruning.include else "exclude"
            value = list(cfg.pruning[key])
            raise ConfigError(f"pruning.{key}", value, "patterns that leave a variable to prune")
        owners = _owners(model)
        self.axes = [input_axes(owners.get(id(v)), len(v.shape)) for v in self.kernels]
        self.masks = [
            tf.Variable(tf.ones(v.shape, tf.float32), trainable=False, name=f"mask/{v.path}")
            for v in self.kernels
        ]
        self.updates: list[tuple[int, float]] = []  # (step, scheduled sparsity)
        self.dense_gzip_bytes = gzip_weights_bytes(model)  # as built, before any pruning

    def update_masks(self, step: int) -> bool:
        """Recompute the masks from the current |w| if `step` is an update step, and apply them
        at once, so the next forward pass already sees the pruned weights."""
        p = self.cfg
        if not is_update_step(p, step, self.total_steps):
            return False
        sparsity = sparsity_at(p, step, self.total_steps)
        for kernel, mask, axes in zip(self.kernels, self.masks, self.axes, strict=True):
            weights = keras.ops.convert_to_numpy(kernel)
            if p.schedule == "m_by_n":
                mask.assign(m_by_n_mask(weights, axes, p.m, p.n))
            else:
                mask.assign(magnitude_mask(weights, sparsity))
        self.apply_masks()
        self.updates.append((step, sparsity))
        return True

    def apply_masks(self) -> None:
        """kernel <- kernel x mask: run eagerly, or traced into the compiled step."""
        for kernel, mask in zip(self.kernels, self.masks, strict=True):
            kernel.assign(kernel.value * tf.cast(mask, kernel.dtype))

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


def build_pruner(model, cfg: DictConfig, total_steps: int) -> Pruner | None:
    """A Pruner for `model` as built (checkpointing's wrapper shares its variables), or None."""
    if cfg.pruning.schedule == "none":
        return None
    pruner = Pruner(model, cfg, total_steps)
    print(
        f"note: pruning={cfg.pruning.schedule} does not lower training memory: the dense "
        f"weights, gradients and optimizer slots all stay, and the masks add a float32 copy of "
        f"each of the {len(pruner.kernels)} pruned kernels ({pruner.mask_bytes() / 2**20:.2f} "
        "MiB, mem/estimate/masks_bytes). It shrinks the compressed weights (prune/gzip_ratio).",
        file=sys.stderr,
    )
    return pruner
