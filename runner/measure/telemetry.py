"""Memory and speed figures, measured the same way on CPU and GPU.

Memory comes from TensorFlow's allocator: on a GPU its own stats, on a CPU the BFC
allocator that runner/__init__.py switches on before TensorFlow loads (the default CPU
allocator keeps no stats: tensorflow/core/common_runtime/process_state.cc reads
TF_CPU_ALLOCATOR_USE_BFC). Where neither is available the process's peak
resident set is the fallback, and `mem/source` says which one a figure came from.
"""

import gc
import os
import re
import shutil
import subprocess
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


def _pool_target(device: str) -> int:
    """Bytes to grow the allocator's pool by before a job: sized for the device.

    CPU: the BFC limit when one is set (TF_CPU_BFC_MEM_LIMIT_IN_MB), else a quarter of the
    machine's memory, at most 4 GiB (the memory is reserved, not touched: see grow_pool). Up
    to 4 GiB the reservation took 0.085 s; from 4.5 GiB on, 0.9-1.4 s of every job's start
    (measured on a 24 GiB machine: 3, 4, 4.5, 5, 6 GiB read 0.085, 0.086, 0.96, 0.94, 0.90 s).
    GPU: 2 GiB, halved until the device gives it.
    """
    if "GPU" in device:
        return 2 * 2**30
    limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB")
    if limit:
        return int(limit) * 2**20 * 3 // 4
    return min(psutil.virtual_memory().total // 4, 4 * 2**30)


class Memory:
    """Tensor-level peak and current bytes of one device, reset per step (or phase).

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
        # What is alive now stays for the job (modules, earlier jobs' results): frozen, the
        # collections during the job skip it (each scanned ~500,000 objects: ~1.5 s).
        gc.freeze()
        self.baseline = 0
        self.baseline = self.current()
        self.start_rss = psutil.Process().memory_info().rss
        self._rss_peak = 0  # the process's RSS high-water, kept across per-phase resets
        self.pool_grown = 0

    def _allocator_counts(self) -> bool:
        """Whether the allocator keeps stats (without TF_CPU_ALLOCATOR_USE_BFC the CPU's raised
        ValueError "Allocator stats not available"): a probe tensor must show in the peak."""
        try:
            with tf.device(self.key):
                probe = tf.ones([1024])  # 4 KiB that must show in the peak
                return tf.config.experimental.get_memory_info(self.key)["peak"] >= probe.shape[0]
        except ValueError:
            return False

    def grow_pool(self) -> None:
        """Grow the allocator's pool with one allocate-and-free, before the job allocates.

        TensorFlow's BFC allocator grows its pool in regions that double in size and splits a
        free chunk only if it is >= 2x the request (or the split saves > 128 MB). XLA asks for
        a compiled step's scratch as one buffer, so without this a 34.7 MiB request held a
        whole 64 MiB chunk and `peak` read base + 32/64/128 MiB whatever the technique (issue
        13: default transformer, none/blocks 69.5/69.5 MiB; after growing, 69.2/40.2 MiB
        against XLA's buffer assignment 69.03/39.98). One large free region makes every
        later request split to its size. `Empty(init=False)` reserves without writing, so no
        page becomes resident. `pool_grown` keeps the bytes grown (0 without an allocator).
        """
        if self.source == "rss":
            return
        size = _pool_target(self.key)
        while size >= 2**26:
            try:
                with tf.device(self.key):
                    block = tf.raw_ops.Empty(shape=[size // 4], dtype=tf.float32, init=False)
                del block
                self.pool_grown = size
                break
            except tf.errors.ResourceExhaustedError:
                size //= 2
        self.reset()

    def reset(self) -> None:
        if self.source != "rss":
            tf.config.experimental.reset_memory_stats(self.key)
        self._rss_peak = max(self._rss_peak, _read_hwm())  # read before the reset below
        _reset_hwm()

    def peak(self) -> int:
        if self.source == "rss":
            return _read_hwm() - self.baseline
        return int(tf.config.experimental.get_memory_info(self.key)["peak"]) - self.baseline

    def peaks(self) -> list[int]:
        """The peak of each local replica's allocator: here one (see ReplicaMemory)."""
        return [self.peak()]

    def current(self) -> int:
        if self.source == "rss":
            return psutil.Process().memory_info().rss - self.baseline
        return int(tf.config.experimental.get_memory_info(self.key)["current"]) - self.baseline

    def peak_rss(self) -> int:
        """The process's peak resident set so far, across every per-phase reset."""
        return max(self._rss_peak, _read_hwm())

    def reserved(self) -> tuple[int, str]:
        """(bytes the system backed for this job so far, how it was read).

        GPU: what nvidia-smi says this process holds (the allocator's pool: TensorFlow never
        returns it). CPU: the resident high-water less the resident size at the job's start:
        the pool's pages that tensors touched (grow_pool touches none) plus the runtime's and
        XLA compiler's own memory. (0, "none") when neither can be read.
        """
        if "GPU" in self.key:
            held = _nvidia_smi_bytes(os.getpid())
            return (held, "nvidia_smi") if held is not None else (0, "none")
        return self.peak_rss() - self.start_rss, "rss_delta"


def nvidia_smi(query: str, timeout: float = 10) -> str | None:
    """nvidia-smi's CSV answer (no header, no units) to `--query-<query>`, or None without
    nvidia-smi or when it fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.stdout if out.returncode == 0 else None


def _nvidia_smi_bytes(pid: int) -> int | None:
    """GPU memory this process holds, per nvidia-smi (MiB), or None without nvidia-smi."""
    out = nvidia_smi("compute-apps=pid,used_memory")
    if out is None:
        return None
    used = [
        int(m)
        for p, m in (line.split(",") for line in out.splitlines() if "," in line)
        if int(p) == pid
    ]
    return sum(used) * 2**20 if used else None


class ReplicaMemory(Memory):
    """The first replica's device as Memory, and every local replica's allocator in peaks():
    GPUs each have their own. CPU devices (logical CPUs) share the process's one allocator,
    so under mirrored on logical CPUs a Memory of the first device counts them all."""

    def __init__(self, devices: list[str]):
        super().__init__(devices[0])
        self.others = [Memory(d, self.source) for d in devices[1:]]

    def grow_pool(self) -> None:
        super().grow_pool()
        for m in self.others:
            m.grow_pool()

    def reset(self) -> None:
        super().reset()
        for m in self.others:
            m.reset()

    def peaks(self) -> list[int]:
        return [self.peak(), *(m.peak() for m in self.others)]


def device_key(name: str) -> str:
    """ "/job:worker/replica:0/task:1/device:GPU:0" -> "GPU:0", as get_memory_info wants."""
    spec = tf.DeviceSpec.from_string(name)
    return f"{spec.device_type}:{spec.device_index}"


def replica_memory(devices: list[str]) -> Memory:
    """Memory over the local replicas' devices: one Memory where they share an allocator."""
    keys = [device_key(d) for d in devices]
    return ReplicaMemory(keys) if all(k.startswith("GPU") for k in keys) else Memory(keys[0])


def speed_figures(
    wait_s: list[float], compute_s: list[float], samples_per_step: int, tokens_per_step: int | None
) -> dict[str, float]:
    """Step-time percentiles and throughput over the steady steps (all but the first).

    p10 and p90 beside the median say how steady the run was: a wide gap means the machine's
    load moved during it (a shared CPU), and a single run's median is then less to go on.

    The first step traces and compiles the tf.function (and XLA); it is reported on its
    own as speed/compile_s. With a single step, that step is all there is to report.
    """
    total = np.asarray(wait_s) + np.asarray(compute_s)
    steady = total[1:] if len(total) > 1 else total
    steady_wait = np.asarray(wait_s[1:] if len(total) > 1 else wait_s)
    figures = {
        "speed/compile_s": float(total[0]),
        "speed/step_time_s_p10": float(np.percentile(steady, 10)),
        "speed/step_time_s_p50": float(np.percentile(steady, 50)),
        "speed/step_time_s_p90": float(np.percentile(steady, 90)),
        "speed/samples_per_s": samples_per_step * len(steady) / float(steady.sum()),
        "speed/input_wait_frac": float(steady_wait.sum() / steady.sum()),
        "speed/timed_steps": len(steady),  # the steps the figures above count
    }
    if tokens_per_step:
        figures["speed/tokens_per_s"] = tokens_per_step * len(steady) / float(steady.sum())
    return figures
