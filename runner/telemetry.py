"""Memory and speed figures, measured the same way on CPU and GPU.

Memory comes from TensorFlow's allocator: on a GPU its own stats, on a CPU the BFC
allocator that runner/__init__.py switches on before TensorFlow loads (the default CPU
allocator keeps no stats; shared GUIDE). Where neither is available the process's peak
resident set is the fallback, and `mem/source` says which one a figure came from.
"""

import gc
import re
from pathlib import Path

import numpy as np
import psutil
import tensorflow as tf


def _read_hwm() -> int:
    """Peak resident set size of this process (VmHWM), in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def _reset_hwm() -> None:
    """Writing 5 to clear_refs resets VmHWM (Linux >= 4.0), so a phase's RSS peak is its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not permitted here: the peak then covers the process's whole life
        pass


class Memory:
    """Tensor-level peak and current bytes of one device, reset per phase.

    Figures are counted from a baseline taken at construction (the start of a job), so a job
    run in-process after others (a sequential Hydra sweep) is not charged for what they
    left allocated: TensorFlow never hands memory back to the OS, but its allocator
    statistics do count frees, so job-relative figures stay comparable (issue 7).
    """

    def __init__(self, device: str, source: str | None = None):
        self.key = device.lstrip("/")  # get_memory_info wants "GPU:0", not "/GPU:0"
        self.source = source or ("gpu_allocator" if "GPU" in self.key else "cpu_bfc_allocator")
        if self.source != "rss" and not self._allocator_counts():
            self.source = "rss"
        gc.collect()  # drop what earlier jobs no longer reference before taking the baseline
        self.baseline = 0
        self.baseline = self.current()

    def _allocator_counts(self) -> bool:
        """Whether the allocator keeps stats (without TF_CPU_ALLOCATOR_USE_BFC the CPU's raised
        ValueError in the shared GUIDE's checks): a probe tensor must show in the peak."""
        try:
            with tf.device(self.key):
                probe = tf.ones([1024])  # 4 KiB that must show in the peak
                return tf.config.experimental.get_memory_info(self.key)["peak"] >= probe.shape[0]
        except ValueError:
            return False

    def reset(self) -> None:
        if self.source != "rss":
            tf.config.experimental.reset_memory_stats(self.key)
        _reset_hwm()

    def peak(self) -> int:
        if self.source == "rss":
            return _read_hwm() - self.baseline
        return int(tf.config.experimental.get_memory_info(self.key)["peak"]) - self.baseline

    def current(self) -> int:
        if self.source == "rss":
            return psutil.Process().memory_info().rss - self.baseline
        return int(tf.config.experimental.get_memory_info(self.key)["current"]) - self.baseline

    @staticmethod
    def peak_rss() -> int:
        return _read_hwm()


def speed_figures(
    wait_s: list[float], compute_s: list[float], samples_per_step: int, tokens_per_step: int | None
) -> dict[str, float]:
    """Step-time percentiles and throughput over the steady steps (all but the first).

    The first step traces and compiles the tf.function (and XLA); it is reported on its
    own as speed/compile_s. With a single step, that step is all there is to report.
    """
    total = np.asarray(wait_s) + np.asarray(compute_s)
    steady = total[1:] if len(total) > 1 else total
    steady_wait = np.asarray(wait_s[1:] if len(total) > 1 else wait_s)
    figures = {
        "speed/compile_s": float(total[0]),
        "speed/step_time_s_p50": float(np.percentile(steady, 50)),
        "speed/step_time_s_p90": float(np.percentile(steady, 90)),
        "speed/samples_per_s": samples_per_step * len(steady) / float(steady.sum()),
        "speed/input_wait_frac": float(steady_wait.sum() / steady.sum()),
    }
    if tokens_per_step:
        figures["speed/tokens_per_s"] = tokens_per_step * len(steady) / float(steady.sum())
    return figures


def timeline_png(current_bytes: list[int], path: Path, title: str) -> Path:
    """Allocator bytes in use after each optimizer step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(1, len(current_bytes) + 1), np.asarray(current_bytes) / 2**20)
    ax.set(xlabel="optimizer step", ylabel="allocated (MiB)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
