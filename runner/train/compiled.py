"""The compiled train and eval steps of what a job trains, made again when the model changes
(pruning=structured's removal: runner/train/removal.py). The loop calls `train`, evaluation
`eval_step`, so a remade pair takes over from the next step on.

Dropping the old steps does not free the old model's variables by itself. A `tf.custom_gradient`
traced into a graph (Keras's optimizer update has one) registers its gradient function in
TensorFlow's global gradient registry under a fresh name and never removes it
(tensorflow/python/ops/custom_gradient.py, _graph_mode_decorator: `@ops.RegisterGradient(name)`
with name "CustomGradient-<uid>"); that function holds the traced graph, whose captures hold
the variables. Measured: a Dense kernel of 1 MiB updated by a traced SGD stayed allocated
after every Python reference to it was gone, and was freed once its entry was removed. So each
make removes every custom gradient registered since the job began to build its model (never
an op's own gradient): those of the dropped steps' traces, whose gradients were taken when
they were traced, and those of the model's own symbolic build (Keras calls each layer once
on symbolic inputs in a scratch graph), whose gradients are never taken. A custom-gradient
layer's build-time entry holds its variables: the transformer's own LayerNorm and attention
kept 1.84 MiB of a removed model alive, the large model's weights, until those entries were
removed too.
"""

import keras

from runner.techniques import precision
from runner.techniques.accumulation import make_train_step
from runner.train.job import Built, Job, gradient_registry
from runner.train.optimizer import make_eval_step

# The names tf.custom_gradient registers under; an op's own gradient (a module imported during
# the run may register one) is never removed.
CUSTOM = "CustomGradient-"


class Compiled:
    """The steps of `built` (its trained model, optimizer and pruner) as `job` runs them."""

    def __init__(self, job: Job, built: Built):
        self.job, self.built = job, built
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.train_step = self.eval_step = None
        self.make()

    def make(self) -> None:
        """The steps of the job's current model; the old ones are dropped (so are their
        graphs' captures of the old variables)."""
        b, job = self.built, self.job
        after_update = b.pruner.after_update if b.pruner else None
        self.train_step = self.eval_step = None
        registry = gradient_registry()
        ours = [n for n in registry if n.startswith(CUSTOM) and n not in b.gradients_before]
        for name in ours:  # of a dropped trace, or of a model's build (module docstring)
            del registry[name]
        self.eval_step = make_eval_step(b.trained, self.loss_fn, job.jit)
        self.train_step = make_train_step(
            b.trained, b.optimizer, self.loss_fn, job.cfg.accum, job.jit, after_update,
            job.strategy,
        )  # fmt: skip

    def train(self, batches):
        return self.train_step(batches)

    def step_metrics(self) -> dict:
        """The loss scale of a loss-scaled optimizer, each step."""
        metrics = precision.step_metrics(self.built.optimizer)
        return metrics() if metrics else {}
