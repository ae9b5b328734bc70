"""TensorFlow's start-up, the same for every entry point: run.py, runner.plan, runner.bench,
runner.launch's workers and every fresh process (probes, sweep jobs, benchmark jobs).

- `prepare_environment()` runs when the `runner` package is first imported, before TensorFlow
  can be: the BFC allocator on the CPU is what makes `get_memory_info('CPU:0')` work
  (tensorflow/core/common_runtime/process_state.cc reads TF_CPU_ALLOCATOR_USE_BFC at its first
  CPU allocation; the default allocator keeps no stats), and TensorFlow's C++ notices (oneDNN,
  CUDA probing, "failed call to cuInit" on a CPU machine, which reads like a crash) are
  silenced unless the user set a level.
- `import_tensorflow()` imports TensorFlow with the C++ stderr silenced (only the import: TF
  2.21 prints absl's "All log messages before absl::InitializeLog()" and INFO lines while it
  loads, whatever TF_CPP_MIN_LOG_LEVEL says), then quiets what TensorFlow's Python side
  prints that is not the user's business (`quiet_python_logs`).
"""

import contextlib
import gc
import logging
import os
import sys

# Set when tfmemlab chose the C++ log level (the user did not): passed on to fresh processes.
QUIET_ENV = "TFMEMLAB_QUIET_TF"

# TensorFlow's own messages that say nothing about the user's job:
NOISE = (
    # TF 1 graph utilities that counting a CNN's FLOPs goes through (tf.compat.v1 profiler):
    # "tensor_shape_from_node_def_name ... is deprecated ... designed for TensorFlow v1".
    "is deprecated and will be removed",
    "This API was designed for TensorFlow v1",
    # PreemptionCheckpointHandler reads its own deprecated `total_run_calls` when it saves.
    "total_run_calls",
)


def prepare_environment() -> None:
    """The environment TensorFlow must find when it loads (module docstring)."""
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    # MLflow draws a progress bar on stderr for every artifact download once tqdm can be
    # imported (mlflow/utils/file_utils.py), and ai-edge-litert (deploy=litert) brings tqdm:
    # loading a kept model printed a dozen "Downloading artifacts" lines. The user's setting wins.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        os.environ[QUIET_ENV] = "1"


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in NOISE)


def quiet_python_logs() -> None:
    """Drop TensorFlow's notices in NOISE, and absl's INFO lines ("Sharding callback
    duration" on every checkpoint save, printed between the progress bar's updates)."""
    tf_logger = logging.getLogger("tensorflow")
    if not any(isinstance(f, _DropNoise) for f in tf_logger.filters):
        tf_logger.addFilter(_DropNoise())
    logging.getLogger("absl").setLevel(logging.WARNING)


@contextlib.contextmanager
def quiet_stderr():
    """The C++ side's stderr (file descriptor 2) silenced inside, when tfmemlab chose the log
    level (QUIET_ENV): TensorFlow's import, the LiteRT converter's and runtime's notices
    ("Created TensorFlow Lite XNNPACK delegate for CPU", runner/deploy/)."""
    if os.environ.get(QUIET_ENV) != "1":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def import_tensorflow():
    """TensorFlow, imported quietly (module docstring); returns the module."""
    fresh = "tensorflow" not in sys.modules
    with quiet_stderr() if fresh else contextlib.nullcontext():
        import tensorflow
    quiet_python_logs()
    if fresh:
        # What the import leaves is modules, not garbage: frozen, Python's collections (and
        # Keras's clear_session's) skip its ~500,000 objects (1.5 s a collection, measured).
        gc.freeze()
    return tensorflow
