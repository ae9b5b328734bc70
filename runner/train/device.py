"""Where the run trains: the GPU when there is one (trainer.device=auto), else the CPU."""

import os

import tensorflow as tf

from runner.core.machine import cpu_model


def setup() -> list:
    """Enable memory growth on every GPU (before any is initialised) and return them.

    Without growth TensorFlow reserves nearly all GPU memory at start, which hides what the
    run itself needs from anyone watching nvidia-smi and starves other processes.
    """
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:  # already initialised in this process (a second in-process run)
            pass
    return gpus


def resolve(name: str, gpus: list) -> str:
    """`auto`/`cpu`/`gpu`/`/GPU:n` -> a TensorFlow device name; errors in one line."""
    if name == "auto":
        return "/GPU:0" if gpus else "/CPU:0"
    if name == "cpu":
        return "/CPU:0"
    if name == "gpu":
        name = "/GPU:0"
    if name.startswith("/GPU:") and int(name.split(":")[1]) >= len(gpus):
        raise RuntimeError(f"trainer.device={name}: this machine has {len(gpus)} GPU(s)")
    return name


def describe(dev: str, gpus: list) -> str:
    """A human name for the device, e.g. "NVIDIA H200" (looked up in the peak-FLOP/s table),
    or "CPU Intel(R) Xeon(R) ... (2 cores)": step times and MFU compare only within one
    device, and machines differ from one day to the next (runner/core/machine.py)."""
    if dev.startswith("/GPU"):
        details = tf.config.experimental.get_device_details(gpus[int(dev.split(":")[1])])
        return details.get("device_name", dev)
    cores = len(os.sched_getaffinity(0))
    return f"CPU {cpu_model()} ({cores} core{'s' if cores > 1 else ''})"
