"""Memory bandwidth and the roofline's ridge point: peak FLOP/s over bandwidth (issue 14).

An op whose arithmetic intensity (FLOPs per byte it reads and writes) is below its device's
ridge point is bound by memory, not by compute: BatchNorm, ReLU, residual adds, LayerNorm and
softmax do a few FLOPs per element moved and sit far below every ridge, so fusing them or
recomputing them saves time and memory where a matmul would not.
"""

import math
import re

from runner.measure import cpu_peak, flops

# Memory bandwidth from the vendors' data sheets, bytes/s, by patterns of the names nvidia-smi
# and TensorFlow report (matched upper-cased; the first that matches wins). Word-bounded like
# flops.GPU_PEAKS, so "A10" does not match "A100" nor "L4" "L40S"; each label's first word
# is its GPU_PEAKS key. The SXM H100 calls itself "NVIDIA H100 80GB HBM3", the PCIe one
# "NVIDIA H100 PCIe"; A100s name their memory ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB
# PCIe", "NVIDIA A100-PCIE-40GB"). Other variants (H100 NVL, V100S, A10G) stay unknown rather
# than take a neighbour's figure.
GPU_BANDWIDTH = {
    "H200": (r"\bH200\b", 4.8e12),
    "H100 PCIe": (r"\bH100\b.*\bPCIE\b", 2.0e12),
    "H100 SXM": (r"\bH100\b.*\b(SXM\d*|HBM3)\b", 3.35e12),
    "A100 80GB": (r"\bA100\b.*\b80GB\b", 2.04e12),
    "A100 40GB": (r"\bA100\b.*\b40GB\b", 1.56e12),
    "V100": (r"\bV100\b", 0.9e12),
    "A10": (r"\bA10\b", 0.6e12),
    "T4": (r"\bT4\b", 0.32e12),
    "L4": (r"\bL4\b", 0.3e12),
}


def gpu_bandwidth_label(device_name: str) -> str | None:
    """The GPU_BANDWIDTH label that `device_name` matches, or None."""
    name = device_name.upper()
    return next((k for k, (p, _) in GPU_BANDWIDTH.items() if re.search(p, name)), None)


def memory_bandwidth(device_name: str, cache_dir) -> tuple[float, str]:
    """(memory bandwidth in bytes/s, where it came from) of `device_name`.

    A CPU (told apart as flops.peak_flops does): a copy timed once and cached in cache_dir
    ("cpu_calibrated"); a GPU: the data-sheet table ("table:<label>"); else (nan, "unknown").
    """
    if "CPU" in device_name.upper():
        return cpu_peak.bandwidth(cache_dir)
    label = gpu_bandwidth_label(device_name)
    if label is None:
        return math.nan, "unknown"
    return GPU_BANDWIDTH[label][1], f"table:{label}"


def ridge_point(
    device_name: str, policy: str, cache_dir, tf32: bool = False, achieved: float = math.nan
) -> dict:
    """The device's peak FLOP/s (as flops.peak_flops gives it for `policy` and `tf32`;
    `achieved`, a rate measured on it, above a cached CPU peak calibrates it again), its
    memory bandwidth, their sources, and the ridge point in FLOPs per byte (nan if either
    figure is unknown)."""
    peak, peak_source = flops.peak_flops(device_name, policy, cache_dir, tf32, achieved)
    bandwidth, bandwidth_source = memory_bandwidth(device_name, cache_dir)
    return {
        "peak_flops": peak,
        "peak_source": peak_source,
        "bandwidth": bandwidth,
        "bandwidth_source": bandwidth_source,
        "ridge": peak / bandwidth,
    }


def table_ridges() -> dict[str, float]:
    """The lowest ridge point, FLOPs per byte, of each GPU in the bandwidth table, over its
    float32, TF32 and 16-bit peaks: an op below it is memory-bound there at any precision.

    H100 PCIe takes the SXM peaks of flops.GPU_PEAKS (its own are ~0.76x), so its ridge
    here is ~1.3x too high.
    """
    return {
        label: min(p for p in flops.GPU_PEAKS[label.split()[0]] if p) / bandwidth
        for label, (_, bandwidth) in GPU_BANDWIDTH.items()
    }
