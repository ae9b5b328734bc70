"""Memory bandwidth and ridge points (issue 14): a CPU copy timed for real and cached beside the
FLOP/s calibrations, data-sheet GPU figures matched by the names GPUs really report."""

import datetime
import json
import math
import os

import pytest

from runner.measure import cpu_peak, roofline
from tests.test_cpu_peak import made_up, write_cache

CPU = "/CPU:0"
BANDWIDTH = "copy_bandwidth"  # this CPU's bandwidth entry: f"{cpu model} x{cores} {BANDWIDTH}"
BUSY = float(os.cpu_count())  # a 1-min load above half the cores
PLAUSIBLE = (0.5e9, 1e12)  # bytes/s: any CPU's memory; a copy that moves nothing is far above


def _entries(tmp_path) -> dict:
    """The cache's entries by key suffix (the part after this CPU's model and core count)."""
    prefix = f"{cpu_peak._cpu_key()} "
    cache = json.loads((tmp_path / cpu_peak.CACHE_FILE).read_text())
    return {k.removeprefix(prefix): v for k, v in cache.items()}


def test_calibration_is_written_beside_the_flops_entry(tmp_path):
    flops = made_up("peak_flops", 1e11, load=0.0)
    write_cache(tmp_path, {"float32": flops})
    value, source = roofline.memory_bandwidth(CPU, tmp_path)
    entries = _entries(tmp_path)
    assert entries["float32"] == flops  # the FLOP/s calibration kept as it was
    entry = entries[BANDWIDTH]
    assert source == entry["source"] == "cpu_calibrated"
    assert len(entry["trials"]) == 5 and value == entry["bytes_per_s"] == max(entry["trials"])
    assert PLAUSIBLE[0] < value < PLAUSIBLE[1]
    assert entry["buffer_bytes"] == 256 * 2**20 and entry["reason"] == "no calibration cached"
    age = datetime.datetime.now(datetime.UTC) - datetime.datetime.fromisoformat(entry["date"])
    assert datetime.timedelta(0) <= age < datetime.timedelta(minutes=5)
    assert len(entry["loadavg"]) == 3


@pytest.mark.parametrize("load", [0.0, BUSY / 2])  # half the cores is not busy yet
def test_cached_bandwidth_is_read_back_without_measuring(tmp_path, load):
    # 1e15 bytes/s: no copy here reaches it, so only the cache can have said it.
    text = write_cache(tmp_path, {BANDWIDTH: made_up("bytes_per_s", 1e15, load)})
    assert cpu_peak.bandwidth(tmp_path) == (1e15, "cpu_calibrated")
    assert (tmp_path / cpu_peak.CACHE_FILE).read_text() == text


@pytest.mark.parametrize("cached", [1e6, 1e15])
def test_busy_cached_bandwidth_is_measured_again_and_the_best_kept(tmp_path, cached):
    # Too low (1e6, as if the machine was busy) or above anything measured now (1e15): either
    # way measured again, and the higher figure kept.
    flops = made_up("peak_flops", 1e11)
    write_cache(tmp_path, {"float32": flops, BANDWIDTH: made_up("bytes_per_s", cached, BUSY)})
    value, source = cpu_peak.bandwidth(tmp_path)
    entries = _entries(tmp_path)
    entry = entries[BANDWIDTH]
    assert source == "cpu_calibrated" and len(entry["trials"]) == 5
    assert value == entry["bytes_per_s"] == max(cached, *entry["trials"])
    assert entry["recalibrations"] == 1 and f"1-min load of {BUSY}" in entry["reason"]
    assert entry["previous"]["bytes_per_s"] == cached and entry["previous"]["loadavg"][0] == BUSY
    assert entries["float32"] == flops


@pytest.mark.serial  # its rates are plausible only on a quiet machine
def test_timed_copy_moves_every_byte():
    # A copy that aliased its input or returned early would report thousands of TB/s, one
    # that stayed in the caches far more than memory delivers: both fail PLAUSIBLE. The test
    # also asked a copy of twice the bytes to take twice as long (median pair 1.5-2.7); on a
    # Xeon with AMX (2026-12-01), run alone, the median pair read 1.08-1.31 from one run to
    # the next (the 512 MiB copy's rate per byte up to 1.8x the 256 MiB one's), so that
    # ratio is not a property of every CPU and is no longer asserted.
    n = cpu_peak.COPY_BYTES
    for _ in range(3):
        small, large = cpu_peak._time_copies(n, 1)[0], cpu_peak._time_copies(2 * n, 1)[0]
        assert PLAUSIBLE[0] < small < PLAUSIBLE[1] and PLAUSIBLE[0] < large < PLAUSIBLE[1]


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("NVIDIA A10", "A10"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", None),  # not an L4
        ("NVIDIA A100", None),  # not an A10, and which A100 is not said
        ("NVIDIA H100 NVL", None),  # neither SXM nor PCIe
    ],
)
def test_gpu_bandwidth_by_the_names_gpus_report(tmp_path, name, label):
    expected = {
        "H200": 4.8e12,
        "H100 SXM": 3.35e12,
        "H100 PCIe": 2.0e12,
        "A100 80GB": 2.04e12,
        "A100 40GB": 1.56e12,
        "V100": 0.9e12,
        "A10": 0.6e12,
        "T4": 0.32e12,
        "L4": 0.3e12,
    }
    value, source = roofline.memory_bandwidth(name, tmp_path)
    if label is None:
        assert math.isnan(value) and source == "unknown"
    else:
        assert (value, source) == (expected[label], f"table:{label}")
    assert not any(tmp_path.iterdir())  # a GPU measures nothing


@pytest.mark.parametrize(
    ("policy", "tf32", "peak"),
    [("float32", False, 67e12), ("float32", True, 494.7e12), ("mixed_bfloat16", False, 989e12)],
)
def test_gpu_ridge_point(tmp_path, policy, tf32, peak):
    ridge = roofline.ridge_point("NVIDIA H100 80GB HBM3", policy, tmp_path, tf32)
    assert ridge == {
        "peak_flops": peak,
        "peak_source": "table:H100:tf32" if tf32 else "table:H100",
        "bandwidth": 3.35e12,
        "bandwidth_source": "table:H100 SXM",
        "ridge": peak / 3.35e12,
    }
    assert math.isnan(roofline.ridge_point("NVIDIA A100", policy, tmp_path)["ridge"])


def test_table_ridges_are_each_gpus_lowest():
    ridges = roofline.table_ridges()
    assert list(ridges) == list(roofline.GPU_BANDWIDTH)
    # The float32 CUDA-core peak is each GPU's slowest: 67 TFLOP/s over 3.35 TB/s on an H100.
    assert ridges["H100 SXM"] == pytest.approx(20.0)
    assert ridges["A100 80GB"] == pytest.approx(19.5 / 2.04)
    assert ridges["V100"] == pytest.approx(15.7 / 0.9)  # no TF32 there
    assert min(ridges.values()) == pytest.approx(19.5 / 2.04)  # the A100 80GB's


@pytest.mark.parametrize(("policy", "ridge"), [("float32", 5.0), ("mixed_bfloat16", 15.0)])
def test_cpu_ridge_point_divides_the_cached_figures(tmp_path, policy, ridge):
    text = write_cache(
        tmp_path,
        {
            "float32": made_up("peak_flops", 1.5e11, load=0.0),
            "bfloat16": made_up("peak_flops", 4.5e11, load=0.0),
            BANDWIDTH: made_up("bytes_per_s", 3e10, load=0.0),
        },
    )
    point = roofline.ridge_point(CPU, policy, tmp_path)
    assert point["ridge"] == pytest.approx(ridge)
    assert point["bandwidth"] == 3e10 and point["bandwidth_source"] == "cpu_calibrated"
    assert point["peak_source"] == "cpu_calibrated"
    assert (tmp_path / cpu_peak.CACHE_FILE).read_text() == text  # nothing measured


def test_a_layer_faster_than_the_cached_peak_calibrates_it_again(tmp_path):
    # The profile passes its fastest layer's FLOP/s: a cached peak below it (taken on a busy
    # machine) is measured again, as a run's MFU does, so no layer sits above the roof.
    write_cache(
        tmp_path,
        {
            "float32": made_up("peak_flops", 1e6, load=0.0),
            BANDWIDTH: made_up("bytes_per_s", 3e10, load=0.0),
        },
    )
    assert roofline.ridge_point(CPU, "float32", tmp_path)["peak_flops"] == 1e6
    point = roofline.ridge_point(CPU, "float32", tmp_path, achieved=2e6)
    assert point["peak_flops"] > 2e6  # this CPU's matmuls run at GFLOP/s
    assert point["ridge"] == pytest.approx(point["peak_flops"] / 3e10)
