"""tfmemlab runner: Hydra config -> tf.data -> Keras model -> own training loop -> MLflow."""

import os

# Must happen before TensorFlow is imported anywhere: the BFC allocator is what makes
# tf.config.experimental.get_memory_info('CPU:0') work (see shared GUIDE, "CPU memory").
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# TensorFlow's C++ notices (oneDNN, CUDA probing, "failed call to cuInit" on a CPU machine,
# which reads like a crash) would come before the run's own lines. A level the user sets wins.
# The marker passes "tfmemlab chose the level" on to sweep jobs run in fresh processes.
QUIET_ENV = "TFMEMLAB_QUIET_TF"
if "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    os.environ[QUIET_ENV] = "1"


def import_tensorflow_quietly() -> None:
    """Import TensorFlow with the C++ stderr silenced, unless the user set a log level.

    TF 2.21 prints absl's "All log messages before absl::InitializeLog()" and INFO lines
    while it loads, whatever TF_CPP_MIN_LOG_LEVEL says; only the import is silenced, so
    Python errors (raised, not printed) and everything after it still show.
    """
    import sys

    if os.environ.get(QUIET_ENV) != "1" or "tensorflow" in sys.modules:
        import tensorflow  # noqa: F401

        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
