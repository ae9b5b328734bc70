"""pruning=m_by_n: structured m:n sparsity (2:4 by default, what NVIDIA's sparse tensor cores
run), chosen on the same clock as the other schedules. tfmot chooses its m:n masks once, at
step 1 (pruning_impl.py:260-262 in tensorflow_model_optimization 0.8.1), on untrained weights;
here they follow begin_step and frequency."""

import math
from dataclasses import dataclass
from typing import ClassVar

from runner.schedules.schedule import Gradual, require


@dataclass
class MbyN(Gradual):
    """In every group of n consecutive weights along a kernel's input axes the m largest |w|
    are kept; the sparsity is 1 - m/n.

    choice_copies (Gradual's): its transposed, padded scores, then top_k's indices beside their
    one-hot (m copies of 2:4's kernel), then their sum. **Measured** under XLA on a CPU: 3.00
    copies of one kernel (60.1 MiB on six 4 MiB Dense kernels, 240.1 at 16 MiB)."""

    name = "m_by_n"
    choice_copies: ClassVar[int] = 3
    schedule: str = "m_by_n"
    m: int = 2  # kept in every group
    n: int = 4  # the group's size

    def check(self, total_steps: int | None = None) -> None:
        require(self.m >= 1, "m", self.m, "a number >= 1")
        require(self.n > self.m, "n", self.n, f"a group size > pruning.m={self.m}")
        super().check(total_steps)

    def sparsity(self, step, total_steps: int):
        import tensorflow as tf

        return tf.constant(1.0 - self.m / self.n, tf.float32)

    def choose(self, scores, sparsity, axes: tuple[int, ...]):
        return m_by_n_mask(scores, axes, self.m, self.n)


def m_by_n_mask(scores, axes: tuple[int, ...], m: int, n: int):
    """Keep the m largest scores in every n consecutive ones along `axes` (flattened in order).

    Like tfmot's generate_m_by_n_mask (pruning_utils.py:193-330), a last shorter group is
    padded; the pads rank below every real score, so it keeps its m largest too. (tfmot's m
    counts zeros; here m counts the weights kept, as in NVIDIA's "2:4". Both mean the same for
    2:4.)
    """
    import numpy as np
    import tensorflow as tf

    perm = [a for a in range(len(scores.shape)) if a not in axes] + list(axes)
    moved = tf.transpose(scores, perm)
    length = math.prod(scores.shape[a] for a in axes)
    rows = tf.reshape(moved, [-1, length])
    padded = tf.pad(rows, [[0, 0], [0, -length % n]], constant_values=-np.inf)
    _, keep = tf.math.top_k(tf.reshape(padded, [-1, n]), k=m)  # ties: lower index first
    groups = tf.reduce_sum(tf.one_hot(keep, n, dtype=tf.float32), axis=1)
    mask = tf.reshape(groups, tf.shape(padded))[:, :length]
    return tf.transpose(tf.reshape(mask, moved.shape), np.argsort(perm))
