"""What stopped training, told to the user in one line (issues 7, 27, 48): out of memory with
the levers to try, a full disk with the path, the space left and the checkpoint kept, or a loss
that is not finite with whether the data held it and what to try.

TensorFlow raises ResourceExhaustedError for both (SaveV2 on a full disk), so the disk is
checked first: only memory exhaustion is called out of memory.
"""

import os
import re
import shutil

import tensorflow as tf

from runner.core.diskfull import disk_full, free_bytes
from runner.core.errors import DiskFull, NonFiniteLoss
from runner.estimate import memory
from runner.track.rundir import CHECKPOINTS
from runner.train.checkpoint import TrainState
from runner.train.job import Built, Job


def out_of_memory(err, job: Job, built: Built):
    """The same error, its message saying what ran out and which levers to try."""
    cfg = job.cfg
    cpu_xla = memory.is_cpu_xla(job.jit, job.device_name)
    on_gpu = memory.on_gpu(job.device_name)
    parts = memory.estimate_memory(
        built.model, built.optimizer, cfg, built.data.spec, cpu_xla, built.remat, on_gpu
    )
    limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB") if not on_gpu else None
    b, k = cfg.data.batch_size, cfg.accum
    halved = f"accum={2 * k} data.batch_size={b // 2} (the same effective batch), " if b > 1 else ""
    # No total where the estimate does not model the activations (model.attention=chunked,
    # a subclassed model): the message says so rather than failing on it.
    total = parts["total"]
    estimated = (
        f"the estimate for this job is {total / 2**20:.1f} MiB "
        if total is not None
        else "the estimate does not model this job's activations "
    )
    message = (
        f"out of memory at optimizer step {getattr(err, 'tfmemlab_step', '?')} with micro-batch "
        f"data.batch_size={b} x accum={k}: {estimated}"
        + (f"against a limit of {limit} MiB " if limit else f"on {job.device_name} ")
        + f"(checkpointing={cfg.checkpointing.policy}, precision={cfg.precision.name}); to "
        f"fit, try {halved}checkpointing=blocks or selective, precision=mixed or bf16, or a "
        f"smaller data.batch_size. TensorFlow: {str(err.message).splitlines()[0][:300]}"
    )
    return tf.errors.ResourceExhaustedError(err.node_def, err.op, message)


def non_finite(err: NonFiniteLoss, job: Job, latest: str | None) -> NonFiniteLoss:
    """The same error, saying what to try: the data's values when an input held NaN or Inf,
    otherwise the levers of a diverging step; and which checkpoint is kept."""
    cfg = job.cfg
    if err.inputs_finite is False:
        where = f" data.path={cfg.data.path}" if cfg.data.get("path") else ""
        advice = f"the data is the cause: clean the values of data={cfg.data.name}{where}"
    else:
        levers = [f"a lower trainer.lr (now {cfg.trainer.lr:g})"]
        if cfg.precision.name != "fp32":
            levers.append(f"precision=fp32 (now {cfg.precision.name})")
        if not cfg.trainer.warmup_steps:
            levers.append("trainer.warmup_steps=100")
        advice = "the step diverged; try " + ", ".join(levers[:-1]) + " or " + levers[-1]
    kept = (
        f"the last checkpoint, {latest}, is kept (python run.py trainer.resume={job.run_dir})"
        if latest
        else "no checkpoint was written"
    )
    return NonFiniteLoss(err.loss, err.step, err.inputs_finite, f"{advice}; {kept}")


def training_fault(err: Exception, job: Job, built: Built, state: TrainState):
    """The error to raise for `err` from the training loop: DiskFull (a checkpoint's half-written
    files removed, the last good one named), out of memory explained, or `err` itself."""
    folder = state.run_dir / CHECKPOINTS
    full = disk_full(err, folder)
    if full is not None:
        # SaveV2 writes into ckpt-<n>_temp/ and leaves it behind when the disk fills: never a
        # checkpoint, and its space is what the user needs back.
        for temp in folder.glob("*_temp"):
            shutil.rmtree(temp, ignore_errors=True)
        full.path = re.sub(r"_temp/.*$", "", str(full.path))  # the checkpoint, not its part
        latest = state.manager.latest_checkpoint
        kept = (
            f"The last good checkpoint, {latest}, is kept: free space, then python run.py "
            f"trainer.resume={job.run_dir}"
            if latest
            else "No checkpoint was written: free space, then run the job again"
        )
        return DiskFull(full.path, full.reason, free_bytes(full.path), kept)
    if isinstance(err, tf.errors.ResourceExhaustedError):
        return out_of_memory(err, job, built)
    if isinstance(err, NonFiniteLoss):
        return non_finite(err, job, state.manager.latest_checkpoint)
    return err
