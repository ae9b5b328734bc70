"""Magnitude schedules: a kernel keeps its largest |w|, at the constant or the polynomially
rising sparsity of tfmot's ConstantSparsity and PolynomialDecay (file:line below are
tensorflow_model_optimization/python/core/sparsity/keras/ in 0.8.1).

A kernel keeps its max(round(size x (1 - s)), 1) largest |w|, at least one weight
(_update_mask, pruning_impl.py:91-100, float32 as there); tfmot also keeps every |w| tied with
the last one kept, we keep exactly that many.
"""

from dataclasses import dataclass

from runner.schedules.schedule import Gradual, require


@dataclass
class Magnitude(Gradual):
    """A kernel's smallest |w| set to zero, target_sparsity of them at the end."""

    target_sparsity: float = 0.5  # the fraction of each kernel set to zero

    def check(self, total_steps: int | None = None) -> None:
        s = self.target_sparsity
        require(0.0 <= s < 1.0, "target_sparsity", s, "a number in [0, 1)")
        super().check(total_steps)

    def choose(self, scores, sparsity, axes: tuple[int, ...]):
        return magnitude_mask(scores, sparsity)


@dataclass
class Constant(Magnitude):
    """pruning=constant: target_sparsity from the first choice on (ConstantSparsity,
    pruning_schedule.py:163-166)."""

    name = "constant"
    schedule: str = "constant"

    def sparsity(self, step, total_steps: int):
        import tensorflow as tf

        return tf.constant(self.target_sparsity, tf.float32)


@dataclass
class Polynomial(Magnitude):
    """pruning=polynomial: gradual magnitude pruning (Zhu & Gupta 2017, eq. 1,
    https://arxiv.org/abs/1710.01878; PolynomialDecay.__call__, pruning_schedule.py:222-246),
    s_t = s_f + (s_i - s_f)(1 - (t - begin_step)/(end_step - begin_step))^power, in float32 op
    for op as tfmot computes it."""

    name = "polynomial"
    schedule: str = "polynomial"
    initial_sparsity: float = 0.0  # s_i, at begin_step
    power: float = 3.0  # tfmot's default exponent

    def check(self, total_steps: int | None = None) -> None:
        s = self.initial_sparsity
        require(0.0 <= s < 1.0, "initial_sparsity", s, "a number in [0, 1)")
        require(self.power > 0, "power", self.power, "a number > 0")
        super().check(total_steps)

    def sparsity(self, step, total_steps: int):
        initial, target = self.initial_sparsity, self.target_sparsity
        return ramp(step, self.begin_step, self.end(total_steps), initial, target, self.power)


def ramp(step, begin: int, end: int, initial: float, target: float, power: float):
    """Zhu & Gupta's polynomial from `initial` at begin to `target` at end, a float32 tensor."""
    import tensorflow as tf

    if end == begin:  # tfmot would divide by zero
        return tf.constant(target, tf.float32)
    done = tf.minimum(1.0, tf.maximum(0.0, tf.cast(step - begin, tf.float32) / (end - begin)))
    return (initial - target) * tf.pow(1 - done, power) + target


def magnitude_mask(scores, sparsity):
    """1 for the max(round(size x (1 - sparsity)), 1) largest scores (|w|), 0 elsewhere."""
    import tensorflow as tf

    flat = tf.reshape(scores, [-1])
    size = flat.shape[0]
    kept = tf.maximum(tf.round(tf.cast(size, tf.float32) * (1 - sparsity)), 1)
    _, order = tf.math.top_k(flat, k=size)  # descending; ties: lower index first, as tfmot
    keep = tf.cast(tf.range(size) < tf.cast(kept, tf.int32), tf.float32)
    return tf.reshape(tf.scatter_nd(order[:, None], keep, [size]), scores.shape)
