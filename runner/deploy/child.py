"""One variant measured in the fresh process it runs in (runner/core/process.py), as it would be
served: loaded, warmed up, timed at batch 1 and at the deploy batch, and run on the validation
inputs, whose outputs go back to the parent to be compared with the Keras model's.

A LiteRT flatbuffer runs in a process without TensorFlow: the LiteRT runtime alone
(`ai_edge_litert.interpreter.Interpreter`, same API as the deprecated tf.lite.Interpreter; its
Python interpreter runs one thread unless told `num_threads`), with XNNPACK, its default CPU
delegate. The SavedModel runs in TensorFlow (`tf.saved_model.load`, its serving signature), on
the CPU allocator's BFC statistics (TF_CPU_ALLOCATOR_USE_BFC, set by runner/__init__.py before
TensorFlow loads), so its tensors' peak is read as well as the process's resident memory.

Memory is the process's resident-set growth (psutil) over loading and the first inference at
batch 1 and at the deploy batch: what serving the model adds to a process that has its runtime
already imported. The file's sha256 is returned with the figures: the parent checks that the
file measured is the variant's.
"""

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil

from runner.core.start import quiet_stderr


def file_digest(path: Path) -> str:
    """sha256 of a file, or of a folder's files in order of their paths (16 hex digits)."""
    path = Path(path)
    sha = hashlib.sha256()
    for file in sorted(p for p in [path, *path.rglob("*")] if p.is_file()):
        sha.update(str(file.relative_to(path) if file != path else "").encode())
        sha.update(file.read_bytes())
    return sha.hexdigest()[:16]


def _calls(call: Callable[[], object], count: int, seconds: float) -> list[float]:
    """Each call's time in ms, for at least `count` calls and at least `seconds`."""
    times, end = [], time.perf_counter() + seconds
    while len(times) < count or time.perf_counter() < end:
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e3)
    return times


def _latency(call: Callable[[np.ndarray], np.ndarray], x: np.ndarray, settings: dict):
    """(p50, p90) in ms of call(x): untimed calls first, at least `warmup` of them and for at
    least `warmup_s`, then at least `repeats` timed ones over at least `min_time_s`; LiteRT's
    benchmark_model does the same by default (0.5 s and 1 s: its warmup_min_secs and
    min_secs, tensorflow/lite/tools/benchmark/benchmark_model.cc). Measured here: a 0.15 ms
    MobileNetV2 at 2 threads read 0.24 ms over its first 100 calls after 10 in 3 fresh
    processes of 5, and 0.14 ms from then on."""
    _calls(lambda: call(x), settings["warmup"], settings["warmup_s"])
    times = _calls(lambda: call(x), settings["repeats"], settings["min_time_s"])
    return float(np.percentile(times, 50)), float(np.percentile(times, 90))


def _batch(inputs: np.ndarray, size: int) -> np.ndarray:
    """The first `size` inputs (repeated when the split has fewer)."""
    reps = -(-size // len(inputs))
    return np.concatenate([inputs] * reps)[:size]


def _measure(load: Callable[[], Callable], inputs: np.ndarray, settings: dict) -> dict:
    """The figures every variant gets: load, memory, latency, and its outputs on `inputs`."""
    batch = settings["batch_size"]
    process = psutil.Process()
    before = process.memory_info().rss
    started = time.perf_counter()
    call = load()
    load_ms = (time.perf_counter() - started) * 1e3
    call(inputs[:1])  # the first inferences at both batches: what serving holds from then on
    call(_batch(inputs, batch))
    rss = process.memory_info().rss - before
    b1 = _latency(call, inputs[:1], settings)
    bn = _latency(call, _batch(inputs, batch), settings)
    outputs = np.concatenate([call(inputs[i : i + batch]) for i in range(0, len(inputs), batch)])
    return {
        "load_ms": load_ms,
        "rss_growth_bytes": rss,
        "latency_b1_p50_ms": b1[0],
        "latency_b1_p90_ms": b1[1],
        "latency_batch_p50_ms": bn[0],
        "latency_batch_p90_ms": bn[1],
        "outputs": outputs.astype(np.float32),
    }


class _LiteRT:
    """A LiteRT interpreter called like a function of a batch: resized to the batch it is
    given; an int8 model's input quantized with its tensor's scale and zero point, its output
    dequantized."""

    def __init__(self, path: Path, threads: int):
        from ai_edge_litert.interpreter import Interpreter

        with quiet_stderr():  # "INFO: Created TensorFlow Lite XNNPACK delegate for CPU."
            self.interpreter = Interpreter(model_path=str(path), num_threads=threads)
            self.interpreter.allocate_tensors()
        self.input = self.interpreter.get_input_details()[0]
        self.output = self.interpreter.get_output_details()[0]
        self.shape = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        it, index = self.interpreter, self.input["index"]
        if self.shape != x.shape:
            it.resize_tensor_input(index, list(x.shape), strict=False)
            it.allocate_tensors()
            self.input = it.get_input_details()[0]
            self.output = it.get_output_details()[0]
            self.shape = x.shape
        dtype = self.input["dtype"]
        scale, zero = self.input["quantization"]
        if np.issubdtype(dtype, np.integer) and scale:  # a quantized input
            info = np.iinfo(dtype)
            x = np.clip(np.round(x / scale + zero), info.min, info.max)
        it.set_tensor(index, x.astype(dtype))
        it.invoke()
        out = it.get_tensor(self.output["index"])
        scale, zero = self.output["quantization"]
        if np.issubdtype(out.dtype, np.integer) and scale:
            return (out.astype(np.float32) - zero) * scale
        return out


def measure_litert(path: str, inputs_file: str, settings: dict) -> dict:
    """A .tflite file's figures (run in a fresh process without TensorFlow)."""
    import ai_edge_litert.interpreter  # noqa: F401 - the runtime's import is not the model's cost

    inputs = np.load(inputs_file)
    figures = _measure(lambda: _LiteRT(Path(path), settings["threads"]), inputs, settings)
    return {**figures, "sha256": file_digest(Path(path)), "pid": os.getpid()}


def measure_saved_model(path: str, inputs_file: str, settings: dict) -> dict:
    """A SavedModel's figures, in TensorFlow (run in a fresh process), with the CPU
    allocator's peak over loading and the first inferences."""
    import tensorflow as tf

    threads = settings["threads"]
    try:  # before the first op; a process whose context is up keeps its own
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:
        pass
    inputs = np.load(inputs_file)
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    except ValueError:  # the allocator keeps no statistics (TF_CPU_ALLOCATOR_USE_BFC unset)
        base = None

    def load():
        serve = tf.saved_model.load(path).signatures["serving_default"]
        (name,) = serve.structured_input_signature[1]
        return lambda x: next(iter(serve(**{name: tf.constant(x)}).values())).numpy()

    figures = _measure(load, inputs, settings)
    if base is not None:
        figures["tf_peak_bytes"] = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
    return {**figures, "sha256": file_digest(Path(path)), "pid": os.getpid()}
