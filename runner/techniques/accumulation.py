"""Gradient accumulation in the compiled optimizer step: `accum` micro-batches -> averaged
gradient -> one update.

One call of the train step is one optimizer step, whatever `accum` is, so
optimizer.iterations, LR schedules and `trainer.max_steps` all count optimizer steps (Keras's
own gradient_accumulation_steps counts schedule steps in micro-batches:
keras/src/optimizers/base_optimizer.py).

With accum=1 the step is one compiled function: gradients, then the update. With accum=k it
takes the k micro-batches one at a time from the input pipeline, each through one compiled
call that adds its gradients in place into float32 accumulator variables, then applies the
sum in one more compiled call. Only one micro-batch is ever materialised (its input,
activations and gradients are dead before the next one is fetched) and the pipeline buffers
micro-batches, exactly as with accum=1, so accumulation costs one float32 copy of the
trainable weights on top of an accum=1 step. (Feeding the k micro-batches as one stacked
[k, batch, ...] tensor to one compiled loop also held the stacked input and the pipeline's
k-fold buffers: MobileNetV2 at 96x96, batch 8, accum 4, float32, peaked 6-14 MiB above accum
1 plus the accumulator, against 0 one at a time; on a GPU that input would sit in device
memory.)
"""

from collections.abc import Iterator

import tensorflow as tf


def make_train_step(
    model, optimizer, loss_fn, accum: int, jit_compile: bool, after_update=None, strategy=None
):
    """train_step(batches) -> (mean loss, finite): one optimizer step on the next `accum`
    (inputs, targets) micro-batches drawn from the iterator `batches`. Without a strategy,
    train_step.calls(x, y) lists its compiled functions with the arguments of a steady step's
    calls, for XLA's plan of them (runner/estimate/xla_plan.py).

    strategy: a tf.distribute strategy (runner/techniques/distribution.py), whose replicas
    each take their part of every micro-batch: make_replicated_step.

    after_update: optional callable traced in right after optimizer.apply, given the step's
    gradients and their variables (pruning's Pruner.after_update, which reads
    optimizer.iterations; structured's taylor importance). It runs once per optimizer step,
    i.e. only after real updates when accum > 1; after an update skipped for float16 overflow
    it finds the weights and optimizer.iterations unchanged."""
    variables = model.trainable_variables
    scale_loss = getattr(optimizer, "scale_loss", lambda loss: loss)
    # Keras's optimizer sums the replicas' gradients (all-reduce): each replica's share is
    # 1/replicas of the mean, as each micro-batch's is 1/accum.
    parts = accum * (strategy.num_replicas_in_sync if strategy is not None else 1)

    def mean_loss(y, logits):
        if strategy is None:
            return loss_fn(y, logits)
        # Under tf.distribute Keras divides a mean loss by the replicas (keras losses/loss.py,
        # scale_loss_for_distribution); here the replicas' share is taken below, explicitly.
        return tf.reduce_mean(loss_fn.call(y, tf.cast(logits, tf.float32)))

    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = mean_loss(y, model(x, training=True))
            # Each micro-batch contributes 1/accum of the mean gradient (exact for powers of
            # two): the accumulated sum is the mean, with no divided copy of it afterwards.
            scaled = scale_loss(loss / parts if parts > 1 else loss)
        return loss, tape.gradient(scaled, variables)

    def update(grads):
        grads = [tf.convert_to_tensor(g) for g in grads]
        # A non-finite gradient in any micro-batch makes the sum non-finite: LossScaleOptimizer
        # then skips the whole update and lowers the scale; we return the flag to count skips.
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        optimizer.apply(grads, variables)
        if after_update is not None:
            after_update(grads, variables)
        return finite

    if strategy is not None:
        return make_replicated_step(strategy, gradients, update, variables, accum, jit_compile)
    if accum == 1:
        return _one_step(gradients, update, jit_compile)
    return _accumulating_step(gradients, update, variables, accum, jit_compile)


def _one_step(gradients, update, jit_compile: bool):
    """accum=1: one compiled function, gradients then the update."""

    @tf.function(jit_compile=jit_compile)
    def step(x, y):
        loss, grads = gradients(x, y)
        return loss, update(grads)

    def train_step(batches: Iterator) -> tuple[tf.Tensor, tf.Tensor]:
        return step(*next(batches))

    train_step.calls = lambda x, y: [(step, (x, y))]
    return train_step


def _accumulating_step(gradients, update, variables, accum: int, jit_compile: bool):
    """accum > 1: each micro-batch's gradients added in place into float32 sums, then the
    update from the sums in a call of its own (module docstring)."""
    # Accumulators as variables, updated with assign_add: a loop-carried sum was measured
    # holding about three copies of the weights at once (old sum, new sum, micro-batch
    # gradients; MobileNetV2 peak(b8, accum4) was peak(b8, accum1) + 3 to 3.7 accumulators).
    sums = float32_sums(variables)

    @tf.function(jit_compile=jit_compile)
    def add_micro_batch(x, y, first):
        loss, grads = gradients(x, y)
        # The first micro-batch overwrites last step's sum: no zeros to allocate (zeroing
        # with zeros_like left ~6 MiB more resident after MobileNetV2 steps). One cond for
        # all variables: one per variable added ~2 s to MobileNetV2's graph build.
        if first:
            for s, g in zip(sums, grads, strict=True):
                s.assign(tf.convert_to_tensor(g))
        else:
            for s, g in zip(sums, grads, strict=True):
                if isinstance(g, tf.IndexedSlices):  # embeddings: add only their rows
                    s.scatter_add(g)
                else:
                    s.assign_add(g)
        return loss

    # The update in a call of its own, after the last micro-batch's activations are freed:
    # its peak (MobileNetV2, 96x96, batch 8: ~50 MiB) stays far below a micro-batch's
    # (~140 MiB). Fusing it into the last micro-batch's call was measured raising float32's
    # peak by ~13 MiB; LossScaleOptimizer's unscaled copy of the sum is made here too.
    @tf.function(jit_compile=jit_compile)
    def apply_sum(losses):
        return tf.add_n(losses) / accum, update([s.value() for s in sums])

    firsts = [tf.constant(i == 0) for i in range(accum)]  # made once, not per step

    def train_step(batches: Iterator) -> tuple[tf.Tensor, tf.Tensor]:
        losses = [add_micro_batch(*next(batches), first) for first in firsts]
        return apply_sum(losses)

    # A later micro-batch's call (it adds into the sums) and the update's
    losses = [tf.zeros(()) for _ in firsts]
    train_step.calls = lambda x, y: [(add_micro_batch, (x, y, firsts[-1])), (apply_sum, (losses,))]
    return train_step


def float32_sums(variables, **placement) -> list[tf.Variable]:
    """One float32 accumulator per trainable variable (`placement`: tf.Variable's
    synchronization and aggregation, under a strategy)."""
    return [
        tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False, name="accum_sum", **placement)
        for v in variables
    ]


def make_replicated_step(strategy, gradients, update, variables, accum: int, jit_compile: bool):
    """The train step under a tf.distribute strategy: each replica's forward and backward
    compiled (XLA when asked), the update outside XLA (Keras's optimizer all-reduces the
    gradients with a cross-replica merge, which XLA does not compile), the loss averaged
    over replicas. With accum > 1 each replica adds its micro-batches' gradients to its own
    float32 sums (ON_READ variables: no communication until the update), as on one device."""
    replica_gradients = tf.function(gradients, jit_compile=jit_compile)

    def mean(per_replica):
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)

    def replica_update(grads):  # ReduceOp has SUM and MEAN only: count the non-finite
        return tf.cast(tf.logical_not(update(grads)), tf.int32)

    def all_finite(per_replica_bad):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_bad, axis=None) == 0

    if accum == 1:

        @tf.function
        def step(x, y):
            def replica(x, y):
                loss, grads = replica_gradients(x, y)
                return loss, replica_update(grads)

            loss, finite = strategy.run(replica, args=(x, y))
            return mean(loss), all_finite(finite)

        return lambda batches: step(*next(batches))

    with strategy.scope():
        sums = float32_sums(
            variables,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )

    @tf.function
    def add_micro_batch(x, y, first):
        def replica(x, y):
            loss, grads = replica_gradients(x, y)
            for s, g in zip(sums, grads, strict=True):
                # assign_add, not s + g: reading the sum would make each gradient wait for
                # that read, a root operation the executor may run late (executor_rules.executor)
                if first:
                    s.assign(tf.convert_to_tensor(g))
                else:
                    s.assign_add(tf.convert_to_tensor(g))
            return loss

        return mean(strategy.run(replica, args=(x, y)))

    @tf.function
    def apply_sum(losses):
        # In a replica's context an ON_READ variable reads that replica's own sum.
        bad = strategy.run(lambda: replica_update([s.read_value() for s in sums]))
        return tf.add_n(losses) / accum, all_finite(bad)

    firsts = [i == 0 for i in range(accum)]  # Python: each position traces its own graph

    def train_step(batches: Iterator) -> tuple[tf.Tensor, tf.Tensor]:
        return apply_sum([add_micro_batch(*next(batches), first) for first in firsts])

    return train_step
