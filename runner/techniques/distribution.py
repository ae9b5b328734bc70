"""tf.distribute for tfmemlab's own loop: replicas, their data, and who logs (issue 18).

`distribution.strategy`:
- `none`: one device, the compiled step as it is (runner/techniques/accumulation.py).
- `mirrored`: tf.distribute.MirroredStrategy over the GPUs (or `distribution.devices`); with
  `distribution.logical_cpus=N` over N logical CPU devices, which is how a machine without GPUs
  (and the tests) runs it, as Keras tests its own TF distribution code.
- `multi_worker`: MultiWorkerMirroredStrategy, the cluster from TF_CONFIG, or under SLURM from
  SlurmClusterResolver when TF_CONFIG is absent. Keras 3's `fit` fails under it
  (keras-team/keras#20585); the loop here runs the step with `strategy.run`, which works.

`data.batch_size` is per replica: a global micro-batch is data.batch_size x replicas, and the
effective batch data.batch_size x accum x replicas. Every worker builds the same seeded
pipeline of global micro-batches and keeps its own contiguous slice of each, split in turn
between its local replicas, so that N replicas see exactly the examples one device sees at the
same global batch, in the same order (the tests compare weights to 1e-5).
"""

import json
import os
import signal
from collections.abc import Callable

import tensorflow as tf

# Set by srun for each task of a SLURM job step: SlurmClusterResolver reads the cluster there.
SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
# Where PreemptionCheckpointHandler keeps its own (empty) checkpoint, in the run directory.
PREEMPTION_DIR = "preemption"


def _tf_config() -> dict:
    return json.loads(os.environ.get("TF_CONFIG") or "{}")


def _in_slurm_step() -> bool:
    return all(v in os.environ for v in SLURM_VARIABLES)


def task() -> tuple[str, int]:
    """(task type, index) of this process in its cluster, from the environment only (before
    TensorFlow starts): TF_CONFIG's task, SLURM's process id, else ("worker", 0)."""
    tf_config = _tf_config()
    if "task" in tf_config:
        return tf_config["task"].get("type", "worker"), int(tf_config["task"].get("index", 0))
    if _in_slurm_step():
        return "worker", int(os.environ["SLURM_PROCID"])
    return "worker", 0


def is_chief(d) -> bool:
    """Whether this process logs to MLflow: every single-process job, and in a multi-worker job
    the chief (TF_CONFIG's `chief` task, or worker 0 when the cluster has no chief).
    d: cfg.distribution."""
    if d.strategy != "multi_worker":
        return True
    kind, index = task()
    cluster = _tf_config().get("cluster", {})
    return kind == "chief" or (kind == "worker" and index == 0 and "chief" not in cluster)


def split_cpu(count: int) -> None:
    """Split the CPU into `count` logical devices; before TensorFlow initialises its devices."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
    )


def make_strategy(d, gpus: list) -> tf.distribute.Strategy | None:
    """The strategy of cfg.distribution `d` (None for `none`); logical CPUs are split here,
    first."""
    if d.strategy == "none":
        return None
    if d.logical_cpus:
        split_cpu(d.logical_cpus)
    if d.strategy == "mirrored":
        kind = "GPU" if gpus else "CPU"
        every = [x.name for x in tf.config.list_logical_devices(kind)]
        return tf.distribute.MirroredStrategy(list(d.devices) if d.devices else every)
    resolver = None
    if "TF_CONFIG" not in os.environ and _in_slurm_step():
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver()
    return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)


def worker_position(strategy) -> int:
    """This worker's place among the job's workers: the chief first, then worker 0, 1, ...
    (MultiWorkerMirroredStrategy's order); 0 in a single-process job."""
    resolver = getattr(strategy, "cluster_resolver", None)
    cluster = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not cluster or resolver.task_type == "chief":
        return 0
    return resolver.task_id + (1 if "chief" in cluster else 0)


def replicas(strategy: tf.distribute.Strategy | None) -> int:
    return strategy.num_replicas_in_sync if strategy is not None else 1


def local_devices(strategy: tf.distribute.Strategy | None, device: str) -> list[str]:
    """The devices this process's replicas run on (`device` alone without a strategy)."""
    if strategy is None:
        return [device]
    return list(strategy.extended.worker_devices)


def worker_batches(strategy, dataset: tf.data.Dataset, batch: int) -> tf.data.Dataset:
    """This worker's contiguous slice of each global micro-batch (batch x replicas): batch x
    its local replicas. A plain tf.data pipeline, so its iterator is checkpointed for exact
    resume (an iterator of strategy.distribute_datasets_from_function is not trackable)."""
    size = batch * len(strategy.extended.worker_devices)
    start = worker_position(strategy) * size

    def own_slice(x, y):
        return x[start : start + size], y[start : start + size]

    return dataset.map(own_slice).prefetch(tf.data.AUTOTUNE)


def feed(strategy, iterator, batch: int):
    """(inputs, targets) micro-batches of the worker -> each local replica's `batch`, in
    replica order, placed on its device."""
    local = len(strategy.extended.worker_devices)

    def per_replica(tensor):
        def part(context) -> tf.Tensor:
            i = context.replica_id_in_sync_group % local
            return tensor[i * batch : (i + 1) * batch]

        return strategy.experimental_distribute_values_from_function(part)

    while True:
        x, y = next(iterator)
        yield per_replica(x), per_replica(y)


def gather(strategy: tf.distribute.Strategy | None, local: list[float]) -> list[float]:
    """One figure per replica, all the job's replicas in replica order, on every worker (a
    collective: every worker calls it). `local`: this process's replicas' figures, in order."""
    if strategy is None:
        return list(local)

    def value(context) -> tf.Tensor:
        return tf.constant([local[context.replica_id_in_sync_group % len(local)]], tf.float64)

    per_replica = strategy.experimental_distribute_values_from_function(value)
    return [float(v) for v in strategy.gather(per_replica, axis=0).numpy()]


def replica_figures(strategy, history, figures: dict, chief: bool) -> tuple[dict, dict]:
    """Memory per replica, for the chief to log (issue 18): `mem/peak_bytes_per_replica/<i>`
    for every replica of the job, and `mem/peak_bytes` the largest. Logical CPUs share the
    process's one allocator, so their replicas' peaks cannot be told apart: then
    `mem/peak_bytes` is all of them together and the estimate is compared with all of them.
    Every worker gets every replica's figures; the chief's `mem/peak_bytes` is the largest."""
    if strategy is None:
        return {}, {}
    local, n = history.steady_replica_peaks, len(strategy.extended.worker_devices)
    estimated = figures.get("mem/estimate_bytes")  # None: activations not modelled
    if len(local) < n:  # this process's replicas share one allocator
        scope = f"all {n} replicas of this process (logical CPUs share one allocator)"
        tags = {"mem/peak_scope": scope, "mem/replicas_per_allocator": n}
        if estimated is None:
            return {}, tags
        return {"mem/measured_over_estimate": figures["mem/peak_bytes"] / (n * estimated)}, tags
    peaks = gather(strategy, local)
    out = {f"mem/peak_bytes_per_replica/{i}": p for i, p in enumerate(peaks)}
    # The workers' step times: the job goes at the pace of the slowest.
    times = gather(strategy, [figures["speed/step_time_s_p50"]] * len(local))
    out.update({f"speed/step_time_s_p50_per_replica/{i}": t for i, t in enumerate(times)})
    if not chief:  # a worker's own metrics.json keeps its own peak
        return out, {"mem/peak_scope": "this worker's replicas' (each has its own allocator)"}
    out["mem/peak_bytes"] = max(peaks)
    if estimated is not None:
        out["mem/measured_over_estimate"] = max(peaks) / estimated
    return out, {"mem/peak_scope": "the largest replica's (each has its own allocator)"}


class WorkersStop:
    """A multi-worker job's stop on a signal: SIGTERM or SIGINT on any one worker stops every
    worker after the same optimizer step, each with its checkpoint, through
    tf.distribute.experimental.PreemptionCheckpointHandler (issue 18). Were a worker to stop
    on its own, the others' next all-reduce would fail (measured: UnavailableError, "tasks
    unhealthy", and the chief's run FAILED instead of resumable).

    The handler learns of a signal from `stop` (runner.train.signals.StopOnSignal, which it polls
    every second) instead of taking SIGTERM's handler over; it tells the other workers through
    the cluster's coordination service, and all of them call `save(step)` after the step it
    names, then `after_step` raises the exception `interrupted(signum, step)` makes: a worker
    the signal did not reach stops as SIGTERM would have stopped it.
    """

    def __init__(self, strategy, run_dir, stop, save: Callable[[int], object], interrupted):
        self.stop, self.interrupted, self.saved = stop, interrupted, 0
        config = tf.distribute.experimental.TerminationConfig(
            termination_watcher_fn=lambda: stop.signum is not None,
            exit_fn=self._exit,
            grace_period=0,
            save_fn=lambda step: (save(step), setattr(self, "saved", step)),
        )
        # The handler restores its manager's newest checkpoint when it is made, and counts
        # steps from the count saved there. Its own empty one keeps that count at 0 on every
        # worker (they all start from the same step); the job's state is restored by
        # runner.train.checkpoint and saved by `save` into the run's checkpoints. (It warns
        # of its own deprecated `total_run_calls` when it saves: runner.core.start drops it.)
        manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(), str(run_dir / PREEMPTION_DIR), max_to_keep=1
        )
        self.handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            strategy.cluster_resolver, manager, termination_config=config
        )

    def _exit(self) -> None:
        raise self.interrupted(self.stop.signum or signal.SIGTERM, self.saved)

    def after_step(self, step: int) -> None:
        """Once per optimizer step on every worker (the handler counts the calls)."""
        self.handler.save_checkpoint_if_preempted(step)
