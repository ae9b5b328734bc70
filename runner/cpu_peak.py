"""The peak FLOP/s of this CPU, for MFU: a matmul calibration cached on disk.

Calibrated once per CPU model, core count and compute dtype, then read back from
`cache_dir/cpu_peak_flops.json`, and calibrated again when a run achieves more than the cached
figure (issue 13): a calibration taken while the machine was busy (a parallel sweep, a
benchmark) is too low and would inflate every later MFU, and an MFU above 1 is impossible.
"""

import datetime
import json
import math
import os
import time
from pathlib import Path

import tensorflow as tf

from runner.device import cpu_model

CACHE_FILE = "cpu_peak_flops.json"
# Compute dtype of each precision policy.
POLICY_DTYPES = {"float32": "float32", "mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


def _cpu_key() -> str:
    """The CPU model and core count: a calibration holds for that pair only."""
    return f"{cpu_model()} x{os.cpu_count()}"


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # no load average on Windows
        return None


def _time_matmuls(dtype: str, n: int, trials: int) -> list[float]:
    """FLOP/s of `trials` timed n x n matmuls (2n^3 FLOPs each) in `dtype`, after a warm-up."""
    with tf.device("/CPU:0"):
        a = tf.cast(tf.random.uniform((n, n)), dtype)
        b = tf.cast(tf.random.uniform((n, n)), dtype)
        tf.reduce_sum(tf.matmul(a, b)).numpy()  # warm-up: thread pool, kernel selection
        rates = []
        for _ in range(trials):
            start = time.perf_counter()
            tf.reduce_sum(tf.matmul(a, b)).numpy()
            rates.append(2.0 * n**3 / (time.perf_counter() - start))
    return rates


def _calibrate_cpu(dtypes, reason: str, n: int = 2048, trials: int = 5) -> dict:
    """A calibration record: the best of `trials` timed matmuls in each of `dtypes`.

    The best trial, not the mean: other work on the machine (a parallel sweep, a benchmark)
    only slows trials down. The date and the load average (1, 5, 15 min; it includes the run
    that just trained) are kept with every trial's figure, to tell a calibration taken on a
    busy machine: measured on this 2-core box, 55 GFLOP/s at a load of 4.6, 169 at 0.9.
    """
    load = _loadavg()
    rates = {dtype: _time_matmuls(dtype, n, trials) for dtype in dtypes}
    return {
        "peak_flops": max(max(r) for r in rates.values()),
        "source": "cpu_calibrated",
        "trials": rates,
        "matmul_n": n,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "loadavg": load,
        "reason": reason,
    }


def _read_cache(path: Path) -> dict:
    """The cache's entries; entries of the older {key: FLOP/s} format are dropped (they carry
    no date, load or trials to judge them by), so those CPUs are calibrated again."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in cache.items() if isinstance(v, dict) and "peak_flops" in v}


def _recalibrate(old: dict, dtypes, achieved: float) -> dict:
    """A new calibration replacing `old`, which a run's `achieved` FLOP/s exceeded."""
    reason = f"a run achieved {achieved:.4g} FLOP/s, above the cached {old['peak_flops']:.4g}"
    entry = _calibrate_cpu(dtypes, reason)
    entry["recalibrations"] = old.get("recalibrations", 0) + 1
    entry["previous"] = {k: old.get(k) for k in ("peak_flops", "source", "date", "loadavg")}
    if achieved > entry["peak_flops"]:
        # Busy again now, or the run used a faster path than these matmuls: the run's own rate
        # is then the best lower bound of the peak there is, and named as such.
        entry.update(peak_flops=achieved, source="cpu_achieved")
    return entry


def _write(path: Path, cache: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: jobs of a multirun may calibrate at once; none reads a half file.
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, path)


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
    path = Path(cache_dir) / CACHE_FILE
    key = f"{_cpu_key()} {dtype}"
    cache = _read_cache(path)
    entry = cache.get(key)
    if entry is None:
        entry = _calibrate_cpu(dtypes, "no calibration cached")
    elif achieved > entry["peak_flops"]:  # False for nan
        entry = _recalibrate(entry, dtypes, achieved)
    else:
        return float(entry["peak_flops"]), entry["source"]
    cache[key] = entry
    _write(path, cache)
    return float(entry["peak_flops"]), entry["source"]
