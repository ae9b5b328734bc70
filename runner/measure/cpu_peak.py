"""The peak FLOP/s and memory bandwidth of this CPU, for MFU and the roofline: calibrations
cached on disk.

Each figure is calibrated once per CPU model and core count (FLOP/s: per compute dtype too),
then read back from `cache_dir/cpu_peak_flops.json` (runner.core.machine.cache_dir: ./outputs,
beside the default store, or the folder $TFMEMLAB_CACHE_DIR names, which any number of
projects and folders on one machine can share). A calibration taken while the machine was
busy (a parallel sweep, a benchmark) is too low (issue 13): the FLOP/s is calibrated again when
a run achieves more than the cached figure (it would inflate every later MFU, and an MFU above
1 is impossible), the bandwidth when it was measured on a busy machine (issue 14).
"""

import datetime
import json
import math
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import tensorflow as tf

from runner.core.machine import cpu_model

CACHE_FILE = "cpu_peak_flops.json"
# Compute dtype of each precision policy.
POLICY_DTYPES = {"float32": "float32", "mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
# The figure each kind of entry holds; any other entry is of an older format.
FIGURES = ("peak_flops", "bytes_per_s")
# Copy buffer: far beyond the caches (the 2-core VM this was written on reports a 105 MiB L3).
COPY_BYTES = 256 * 2**20


def _cpu_key() -> str:
    """The CPU model and core count: a calibration holds for that pair only."""
    return f"{cpu_model()} x{os.cpu_count()}"


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # no load average on Windows
        return None


def _rates(run: Callable, work: float, trials: int) -> list[float]:
    """`work` per second of each of `trials` timed calls of `run`, after an untimed warm-up
    (thread pool, kernel selection, the allocator's pool)."""
    run()
    rates = []
    for _ in range(trials):
        start = time.perf_counter()
        result = run()
        rates.append(work / (time.perf_counter() - start))
        del result  # freed after the clock stops: freeing is not part of the work
    return rates


def _time_matmuls(dtype: str, n: int, trials: int) -> list[float]:
    """FLOP/s of `trials` timed n x n matmuls (2n^3 FLOPs each) in `dtype`, after a warm-up."""
    with tf.device("/CPU:0"):
        a = tf.cast(tf.random.uniform((n, n)), dtype)
        b = tf.cast(tf.random.uniform((n, n)), dtype)
        return _rates(lambda: tf.reduce_sum(tf.matmul(a, b)).numpy(), 2.0 * n**3, trials)


def _time_copies(nbytes: int, trials: int) -> list[float]:
    """Bytes/s of `trials` timed copies of an `nbytes` float32 buffer (each reads and writes
    it: 2 x nbytes moved), after a warm-up.

    DeepCopy always writes a new buffer: `tf.identity` on a CPU hands back the input's own
    buffer (512 MiB "copied" in 20 us here). Eager CPU ops return once done. DeepCopy is a
    multi-threaded memcpy, which for buffers this large stores around the cache on x86;
    elementwise kernels store through it and read each written line first, so `x * 1.0`
    reaches ~0.65x this rate counted the same way (20 vs 31 GB/s here).
    """
    with tf.device("/CPU:0"):
        x = tf.ones([nbytes // 4], tf.float32)
        return _rates(lambda: tf.raw_ops.DeepCopy(x=x), 2.0 * nbytes, trials)


def _calibration(reason: str, measure: Callable[[], dict]) -> dict:
    """A cache entry: the figures measure() returns, with the date, the load average before
    measuring and why."""
    load = _loadavg()
    return {
        **measure(),
        "source": "cpu_calibrated",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "loadavg": load,
        "reason": reason,
    }


def _calibrate_cpu(dtypes, reason: str, n: int = 2048, trials: int = 5) -> dict:
    """A calibration record: the best of `trials` timed matmuls in each of `dtypes`.

    The best trial, not the mean: other work on the machine (a parallel sweep, a benchmark)
    only slows trials down. The date and the load average (1, 5, 15 min; it includes the run
    that just trained) are kept with every trial's figure, to tell a calibration taken on a
    busy machine: measured on this 2-core box, 55 GFLOP/s at a load of 4.6, 169 at 0.9.
    """

    def measure() -> dict:
        rates = {dtype: _time_matmuls(dtype, n, trials) for dtype in dtypes}
        return {"peak_flops": max(max(r) for r in rates.values()), "trials": rates, "matmul_n": n}

    return _calibration(reason, measure)


def _calibrate_copy(reason: str, nbytes: int = COPY_BYTES, trials: int = 5) -> dict:
    """A bandwidth record: the best of `trials` timed copies (best, as for the FLOP/s)."""

    def measure() -> dict:
        rates = _time_copies(nbytes, trials)
        return {"bytes_per_s": max(rates), "trials": rates, "buffer_bytes": nbytes}

    return _calibration(reason, measure)


def _read_cache(path: Path) -> dict:
    """The cache's entries; entries of the older {key: FLOP/s} format are dropped (they carry
    no date, load or trials to judge them by), so those CPUs are calibrated again."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in cache.items() if isinstance(v, dict) and set(FIGURES) & set(v)}


def _write(path: Path, cache: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: jobs of a multirun may calibrate at once; none reads a half file.
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, path)


def _redo(old: dict, figure: str, calibrate: Callable[[str], dict], reason: str) -> dict:
    """A new calibration replacing `old`, with a count of them and what `old` said."""
    entry = calibrate(reason)
    entry["recalibrations"] = old.get("recalibrations", 0) + 1
    entry["previous"] = {k: old.get(k) for k in (figure, "source", "date", "loadavg")}
    return entry


def _cached(cache_dir, key: str, calibrate, redo) -> dict:
    """The cache entry `key`: calibrate(reason) when there is none, or redo(entry) when that
    returns a new one rather than None; a new entry is written beside the others."""
    path = Path(cache_dir) / CACHE_FILE
    old = _read_cache(path).get(key)
    try:
        entry = calibrate("no calibration cached") if old is None else redo(old)
    except tf.errors.ResourceExhaustedError:
        # Under a CPU BFC limit (TF_CPU_BFC_MEM_LIMIT_IN_MB, as memory studies and accum=auto's
        # probes set it) the 2048^2 matmuls or the copy buffer may not fit: the run's figures
        # must not fail on it, and nothing is cached from it.
        if old is not None:
            return old
        return {**dict.fromkeys(FIGURES, math.nan), "source": "uncalibrated: out of memory"}
    if entry is None:
        return old
    # Read again: another job may have cached another figure while this one measured.
    cache = _read_cache(path)
    cache[key] = entry
    _write(path, cache)
    return entry


def _recalibrate(old: dict, dtypes, achieved: float) -> dict:
    """A new calibration replacing `old`, which a run's `achieved` FLOP/s exceeded."""
    reason = f"a run achieved {achieved:.4g} FLOP/s, above the cached {old['peak_flops']:.4g}"
    entry = _redo(old, "peak_flops", partial(_calibrate_cpu, dtypes), reason)
    if achieved > entry["peak_flops"]:
        # Busy again now, or the run used a faster path than these matmuls: the run's own rate
        # is then the best lower bound of the peak there is, and named as such.
        entry.update(peak_flops=achieved, source="cpu_achieved")
    return entry


def peak(cache_dir, policy: str, achieved: float = math.nan) -> tuple[float, str]:
    """(peak FLOP/s, source) of this CPU under the precision `policy`.

    `achieved`: the run's FLOP/s (nan: unknown); above the cached peak, it triggers a new
    calibration. The peak of a 16-bit policy is the faster of float32 and its 16-bit dtype:
    XLA on a CPU without native 16-bit math computes in float32, while one with AMX or
    AVX512_BF16 multiplies bfloat16 several times faster than float32 (2048^2 matmuls on a
    2-core Xeon with AMX: ~115-170 GFLOP/s float32, ~330-500 bfloat16).
    """
    dtype = POLICY_DTYPES.get(policy, "float32")
    dtypes = sorted({"float32", dtype})

    def redo(old: dict) -> dict | None:
        return _recalibrate(old, dtypes, achieved) if achieved > old["peak_flops"] else None

    entry = _cached(cache_dir, f"{_cpu_key()} {dtype}", partial(_calibrate_cpu, dtypes), redo)
    return float(entry["peak_flops"]), entry["source"]


def _remeasure_copy(old: dict) -> dict | None:
    """A new bandwidth entry if `old` was measured on a busy machine (1-min load above half the
    cores), keeping the best figure ever measured: a busy machine only slows copies down. The
    new entry's load is the new measurement's, so one taken on a busy machine again is redone
    at the next call (it costs ~0.3 s)."""
    cores = os.cpu_count() or 1
    load = (old.get("loadavg") or [0.0])[0]
    if load <= cores / 2:
        return None
    reason = f"the cached figure was measured at a 1-min load of {load} on {cores} cores"
    entry = _redo(old, "bytes_per_s", _calibrate_copy, reason)
    entry["bytes_per_s"] = max(entry["bytes_per_s"], old["bytes_per_s"])
    return entry


def bandwidth(cache_dir) -> tuple[float, str]:
    """(memory copy bandwidth in bytes/s, source) of this CPU: the best of 5 timed copies of a
    256 MiB buffer, counted as read + write, cached beside the FLOP/s calibrations."""
    entry = _cached(cache_dir, f"{_cpu_key()} copy_bandwidth", _calibrate_copy, _remeasure_copy)
    return float(entry["bytes_per_s"]), entry["source"]
