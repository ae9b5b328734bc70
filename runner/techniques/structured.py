"""pruning=structured in training: whole channels masked on the schedule's clock, then removed.

The channel groups are read from the functional model's graph (runner/channels/groups.py). A
mask is one float32 vector per weight axis a group indexes (a kernel's output axis, the next
layer's input rows, BatchNorm's vectors), 1 for a kept channel, 0 for a masked one:
- `choose(step)`, on the host between two steps, when the schedule chooses at `step`: each
  group's channels ranked by importance (runner/channels/select.py), the lowest masked at the
  schedule's fraction, and the weights multiplied by their masks at once;
- `after_update(grads, variables)`, traced into the compiled step right after the optimizer's
  update (as the magnitude Pruner's): the weights multiplied by their masks again, and under
  importance=taylor |w x g| added along each masked axis (Molchanov et al., CVPR 2019);
- `remove(optimizer)` after end_step: the model rebuilt without its masked channels, their
  weights and optimizer slots sliced (runner/channels/surgery.py), which equals the masked
  model. The caller trains the smaller model from there (runner/train/removal.py).
"""

import re
import sys

import keras
import numpy as np
import tensorflow as tf
from omegaconf import DictConfig

from models.common import is_graph
from runner.channels.groups import channel_groups
from runner.channels.select import by_position, choose, scores
from runner.channels.surgery import carry_optimizer, removed_positions, smaller
from runner.core.errors import ConfigError
from runner.schedules import schedule_of


def _element(kind: str, weight_of):
    """l1: |w|, l2: w^2, of every element of a weight."""
    if kind == "l1":
        return lambda layer, index: np.abs(weight_of(layer, index))
    return lambda layer, index: np.square(weight_of(layer, index))


class ChannelPruner:
    """Masks over a functional model's channel groups (module docstring)."""

    def __init__(self, model, p: DictConfig, total_steps: int):
        self.schedule = schedule_of(p)
        self.schedule.check_steps(total_steps)
        if not is_graph(model):
            allowed = "a functional or Sequential model (a subclassed model's graph is unknown)"
            raise ConfigError("pruning.schedule", "structured", allowed)
        self.model, self.total_steps = model, total_steps
        self.end = self.schedule.end(total_steps)
        self.analysis = channel_groups(model)
        self.groups = self._chosen_groups(p)
        if self.untouched:  # also the run's prune/untouched tag (runner/report/structured.py)
            whole = "; ".join(f"{name}: {why}" for name, why in self.untouched.items())
            print(f"note: pruning=structured leaves these layers whole: {whole}", file=sys.stderr)
        self.kept: dict[int, np.ndarray] = {}  # the last choice: a group's root -> kept indices
        self.removed = False
        self.choices: list[tuple[int, float]] = []  # (step, fraction) of each choice
        keys = sorted({(s.layer, s.weight, s.axis) for s in self.analysis.slots})
        self.keys = keys
        self.masks = [
            tf.Variable(tf.ones([self._weight(k).shape[k[2]]]), trainable=False, name="channels")
            for k in keys
        ]
        self.taylor = []
        if self.schedule.importance == "taylor":
            self.taylor = [
                tf.Variable(tf.zeros_like(m), trainable=False, name="taylor") for m in self.masks
            ]

    def _weight(self, key):
        layer, index = key[0], key[1]
        return self.model.get_layer(layer).weights[index]

    def _chosen_groups(self, p: DictConfig) -> list[int]:
        """The prunable groups whose producers pruning.include (if given) names and
        pruning.exclude does not."""
        a = self.analysis

        def named(g: int, patterns) -> bool:
            return any(re.search(x, name) for x in patterns for name in a.groups[g].made_by)

        chosen = [g for g in a.prunable() if not p.include or named(g, p.include)]
        chosen = [g for g in chosen if not named(g, p.exclude)]
        if not chosen:
            key = "include" if p.include else "exclude"
            why = "patterns that leave a channel group to prune (layer names)"
            raise ConfigError(f"pruning.{key}", list(p[key]), why)
        return chosen

    @property
    def untouched(self) -> dict[str, str]:
        """Layers left whole: name -> why."""
        return dict(self.analysis.untouched)

    def _products(self):
        """Each masked weight with its masks, broadcast along their axes."""
        by_weight: dict[tuple, list] = {}
        for key, mask in zip(self.keys, self.masks, strict=True):
            by_weight.setdefault(key[:2], []).append((key[2], mask))
        for (layer, index), masks in by_weight.items():
            yield self.model.get_layer(layer).weights[index], masks

    def apply(self) -> None:
        """weight <- weight x its masks (eager, or traced into the step)."""
        if self.removed:
            return
        for weight, masks in self._products():
            factor = 1.0
            for axis, mask in masks:
                shape = [1] * len(weight.shape)
                shape[axis] = -1
                factor = factor * tf.reshape(mask, shape)
            weight.assign(weight.value * tf.cast(factor, weight.dtype))

    def after_update(self, grads=None, variables=None) -> None:
        """Traced into the step after the optimizer's update: taylor's sums, then the masks."""
        if self.removed:
            return
        if self.taylor and grads is not None:
            self._add_taylor(grads, variables)
        self.apply()

    def _add_taylor(self, grads, variables) -> None:
        grad_of = {id(v): g for v, g in zip(variables, grads, strict=True)}
        for key, total in zip(self.keys, self.taylor, strict=True):
            weight = self._weight(key)
            grad = grad_of.get(id(weight))
            if grad is None:  # a BatchNorm statistic: no gradient
                continue
            value = tf.abs(tf.cast(weight.value, tf.float32) * tf.cast(grad, tf.float32))
            axes = [i for i in range(len(weight.shape)) if i != key[2]]
            add = tf.reduce_sum(value, axis=axes)
            total.assign_add(tf.where(tf.math.is_finite(add), add, tf.zeros_like(add)))

    def _position(self):
        if self.schedule.importance == "taylor":
            sums = dict(zip(self.keys, self.taylor, strict=True))
            return lambda layer, weight, axis: sums[(layer, weight, axis)].numpy()

        def weight_of(layer, index):
            value = self.model.get_layer(layer).weights[index]
            return keras.ops.convert_to_numpy(value).astype(np.float32)

        return by_position(_element(self.schedule.importance, weight_of))

    def choose(self, step: int) -> bool:
        """Before optimizer step `step`: the masks of a choice step chosen and applied."""
        s = self.schedule
        if self.removed or not bool(s.is_update_step(step, self.total_steps)):
            return False
        fraction = float(s.sparsity(step, self.total_steps))
        score = scores(self.analysis, self._position())
        score = {g: score[g] for g in self.groups}
        self.kept = choose(self.analysis, score, fraction, s.round_to)
        for key, gone in removed_positions(self.analysis, self.kept).items():
            self.masks[self.keys.index(key)].assign((~gone).astype(np.float32))
        for total in self.taylor:
            total.assign(tf.zeros_like(total))
        self.choices.append((step, fraction))
        self.apply()
        return True

    def kept_from_masks(self) -> dict[int, np.ndarray]:
        """The channels each chosen group keeps, read from its masks (as a checkpoint has
        them)."""
        a, kept = self.analysis, {}
        for s in a.slots:
            mask = self.masks[self.keys.index((s.layer, s.weight, s.axis))].numpy() > 0
            roots = np.array([a.find(int(g)) for g in s.group])
            for g in set(roots.tolist()) & set(self.groups) - kept.keys():
                kept[g] = np.unique(s.index[(roots == g) & mask])
        return kept

    def remove(self, optimizer, kept: dict | None = None):
        """The model rebuilt without its masked channels (those of `kept`, a marker's; else
        the masks'), and the optimizer for it with its state carried over: (small model,
        optimizer)."""
        if kept is None:
            self.kept = self.kept_from_masks()
        else:
            self.kept = {int(g): np.asarray(k, dtype=np.int64) for g, k in kept.items()}
        small = smaller(self.model, self.analysis, self.kept)
        carried = carry_optimizer(optimizer, self.model, small, self.analysis, self.kept)
        self.model, self.removed = small, True
        self.masks, self.taylor = [], []
        return small, carried

    def removed_groups(self) -> int:
        """Groups that lost channels in the last choice."""
        return sum(len(k) < self.analysis.groups[g].size for g, k in self.kept.items())

    def kept_json(self) -> dict:
        return {str(g): [int(i) for i in k] for g, k in self.kept.items()}
