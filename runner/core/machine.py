"""What CPU this is, read at run time: machines differ from one day to the next (the
same project ran on CPUs with and without AVX512_BF16: docs/findings.md);
and where its calibrations (runner/measure/cpu_peak.py) are cached."""

import os
import platform
from pathlib import Path

CACHE_ENV = "TFMEMLAB_CACHE_DIR"


def cache_dir() -> Path:
    """Where this machine's calibrations are cached: $TFMEMLAB_CACHE_DIR (a folder any number
    of projects and working folders can share), else ./outputs, beside the default store."""
    return Path(os.environ.get(CACHE_ENV) or "outputs")


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where there is none)."""
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (avx512_bf16, amx_bf16, ...); empty where unknown."""
    for line in _cpuinfo():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_bf16() -> bool:
    """AVX512_BF16 or AMX: the CPU instructions for native bfloat16 math."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_onednn_bf16() -> bool:
    """Whether TensorFlow gives bfloat16 operations to oneDNN on this CPU (where its oneDNN
    operations are on): AVX512F or AVX_NE_CONVERT, TensorFlow's own test
    (IsBF16SupportedByOneDNNOnThisCPU); oneDNN emulates the bfloat16 math without
    AVX512_BF16."""
    return bool({"avx512f", "avx_ne_convert"} & cpu_flags())


def cpu_onednn_fp16() -> bool:
    """Whether TensorFlow gives float16 operations to oneDNN on this CPU (where its oneDNN
    operations are on): AVX512BW with AVX512_FP16 or AMX_FP16, or AVX_NE_CONVERT, TensorFlow's
    own test (IsDataTypeSupportedByOneDNNOnThisCPU for DT_HALF); elsewhere float16 takes
    TensorFlow's own kernels."""
    flags = cpu_flags()
    return bool("avx512bw" in flags and {"avx512_fp16", "amx_fp16"} & flags) or (
        "avx_ne_convert" in flags
    )


def cpu_kernels(precision: str) -> str:
    """Whose kernels run a 16-bit precision ("bf16" or "mixed") on this CPU: for bfloat16
    "onednn" with AVX512_BF16/AMX, "onednn_emulated" with AVX512F alone (cpu_onednn_bf16),
    else "tensorflow" (TensorFlow's own); for float16 "onednn" where TensorFlow gives it to
    oneDNN (cpu_onednn_fp16), else "tensorflow"."""
    if precision == "mixed":
        return "onednn" if cpu_onednn_fp16() else "tensorflow"
    if cpu_has_bf16():
        return "onednn"
    return "onednn_emulated" if cpu_onednn_bf16() else "tensorflow"
