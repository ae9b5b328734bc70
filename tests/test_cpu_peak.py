"""CPU peak FLOP/s: calibrated robustly, cached with its date and load, redone when a run beats
it (issue 13). Each calibration is real: about a second of timed 2048^2 matmuls."""

import datetime
import json
import math

import pytest

from runner.measure import cpu_peak, flops

CPU = "/CPU:0"


def _cache(tmp_path) -> dict:
    return json.loads((tmp_path / cpu_peak.CACHE_FILE).read_text())


def made_up(figure: str, value: float, load: float = 9.0) -> dict:
    """A made-up calibration of `figure` ("peak_flops" or "bytes_per_s"), taken at a 1-min load
    of `load` (9: a busy machine)."""
    return {
        figure: value,
        "source": "cpu_calibrated",
        "trials": [value],
        "date": "2000-01-01T00:00:00+00:00",
        "loadavg": [load, 9.0, 9.0],
        "reason": "made up by the test",
    }


def write_cache(tmp_path, entries: dict) -> str:
    """A cache file holding `entries` under this CPU's keys (key suffix: entry); returns its
    text."""
    text = json.dumps({f"{cpu_peak._cpu_key()} {k}": v for k, v in entries.items()})
    (tmp_path / cpu_peak.CACHE_FILE).write_text(text)
    return text


def _write_entry(tmp_path, dtype: str, peak: float) -> str:
    """A cache holding one made-up calibration for this CPU, taken on a busy machine."""
    return write_cache(tmp_path, {dtype: made_up("peak_flops", peak)})


@pytest.mark.parametrize(
    ("policy", "dtypes", "old_cache"),
    [("float32", ["float32"], True), ("mixed_bfloat16", ["bfloat16", "float32"], False)],
)
def test_calibration_keeps_best_trial_date_and_load(tmp_path, policy, dtypes, old_cache):
    if old_cache:  # the format before issue 13, {cpu: FLOP/s}: replaced, not read
        (tmp_path / cpu_peak.CACHE_FILE).write_text(json.dumps({cpu_peak._cpu_key(): 1.0}))
    peak, source = flops.peak_flops(CPU, policy, tmp_path)
    assert source == "cpu_calibrated"
    cache = _cache(tmp_path)
    assert list(cache) == [f"{cpu_peak._cpu_key()} {cpu_peak.POLICY_DTYPES[policy]}"]
    entry = cache.popitem()[1]
    assert sorted(entry["trials"]) == dtypes and all(len(t) == 5 for t in entry["trials"].values())
    # The best trial over the dtypes the policy may compute in, not a mean.
    assert peak == entry["peak_flops"] == max(max(t) for t in entry["trials"].values()) > 1e9
    age = datetime.datetime.now(datetime.UTC) - datetime.datetime.fromisoformat(entry["date"])
    assert datetime.timedelta(0) <= age < datetime.timedelta(minutes=5)
    assert len(entry["loadavg"]) == 3 and entry["reason"] == "no calibration cached"


@pytest.mark.parametrize("achieved", [math.nan, 1e14])
def test_cached_peak_above_the_run_is_read_back_as_is(tmp_path, achieved):
    text = _write_entry(tmp_path, "float32", 1e15)
    assert flops.peak_flops(CPU, "float32", tmp_path, achieved=achieved) == (
        1e15,
        "cpu_calibrated",
    )
    assert (tmp_path / cpu_peak.CACHE_FILE).read_text() == text  # not calibrated again


def test_run_above_cached_peak_recalibrates(tmp_path):
    # A calibration far too low, as if taken on a busy machine; the run achieved 100x more.
    _write_entry(tmp_path, "float32", 1e6)
    per_step, seconds = 1e8, 1.0
    achieved = flops.achieved_flops(per_step, seconds)
    peak, source = flops.peak_flops(CPU, "float32", tmp_path, achieved=achieved)
    entry = _cache(tmp_path).popitem()[1]
    assert source == "cpu_calibrated" and peak == entry["peak_flops"] > achieved
    assert peak == max(entry["trials"]["float32"])  # measured, not the run's figure
    assert entry["recalibrations"] == 1 and "achieved 1e+08 FLOP/s" in entry["reason"]
    assert entry["previous"]["peak_flops"] == 1e6 and entry["previous"]["loadavg"] == [9.0] * 3
    assert 0 < flops.mfu(per_step, seconds, peak) <= 1


def test_run_above_a_fresh_calibration_becomes_the_peak(tmp_path):
    # 1e18 FLOP/s beats any CPU's matmuls: after recalibrating, the run's own rate is the best
    # lower bound of the peak, named as such, and the MFU is 1, not above.
    _write_entry(tmp_path, "bfloat16", 1e6)
    peak, source = flops.peak_flops(CPU, "mixed_bfloat16", tmp_path, achieved=1e18)
    assert (peak, source) == (1e18, "cpu_achieved")
    entry = _cache(tmp_path).popitem()[1]
    assert entry["source"] == "cpu_achieved" and max(entry["trials"]["float32"]) < 1e18
    assert flops.mfu(1e18, 1.0, peak) == 1.0


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((3e9, 2.0), 1.5e9),
        ((1e9, 0.0), math.nan),
        ((math.nan, 1.0), math.nan),
        ((1e9, None), math.nan),
    ],
)
def test_achieved_flops(args, expected):
    value = flops.achieved_flops(*args)
    assert (math.isnan(value) and math.isnan(expected)) or value == expected


def test_a_calibration_that_runs_out_of_memory_leaves_the_figure_unknown_and_caches_nothing(
    tmp_path,
):
    """Under a CPU BFC limit (memory studies, accum=auto's probes) the 2048^2 matmuls and the
    256 MiB copy do not fit: the run's figures go on without them, and a later run with
    memory to spare calibrates properly."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = (
        "from runner.measure import cpu_peak; "
        f"f = cpu_peak.peak({str(tmp_path)!r}, 'float32'); "
        f"b = cpu_peak.bandwidth({str(tmp_path)!r}); print(*f, *b, sep='|')"
    )
    env = {"TF_CPU_BFC_MEM_LIMIT_IN_MB": "24", "TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    unknown = "nan|uncalibrated: out of memory"
    assert done.stdout.strip() == f"{unknown}|{unknown}"
    assert not (tmp_path / cpu_peak.CACHE_FILE).exists()
