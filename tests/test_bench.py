"""The GPU check's own code, run on the CPU at a tiny size, so that the one run on a GPU
machine does not fail on a bug a CPU could have caught."""

import re

import pytest

from runner.bench import gpu_check
from tests.conftest import TINY, TINY_DATA
from tests.test_telemetry import HAS_GPU


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal on a machine without a GPU")
def test_gpu_check_refuses_a_machine_without_a_gpu():
    with pytest.raises(SystemExit, match="gpu_check needs a GPU"):
        gpu_check.main([])


@pytest.mark.slow
def test_gpu_check_compares_each_precision_with_fp32(capsys):
    tiny = [*TINY["transformer"], *TINY_DATA, "trainer.max_steps=3", "trainer.device=cpu"]
    results = gpu_check.compare(tiny)
    out = capsys.readouterr().out
    assert list(results) == ["fp32", "mixed", "bf16"]
    # Each job ran under its own policy: only float16 has loss scaling and counts skips.
    assert ["precision/skipped_steps" in r for r in results.values()] == [False, True, False]
    for r in results.values():
        assert all(r[k] > 0 for k in ("mem/peak_bytes", "speed/step_time_s_p50"))
    header = out.splitlines()[0].split()
    assert header == ["precision", *gpu_check.KEYS]
    for p in ("mixed", "bf16"):
        line = re.search(
            rf"^{p}\s+/ fp32: peak (\d+\.\d\d) \(target <= 0.75\).* (ok|MISSED)$", out, re.M
        )
        assert line, out
        ratio = results[p]["mem/peak_bytes"] / results["fp32"]["mem/peak_bytes"]
        assert float(line.group(1)) == pytest.approx(ratio, abs=0.005)
        assert line.group(2) == ("ok" if ratio <= gpu_check.TARGET else "MISSED")
    assert re.search(r"^gpu_check: 3 jobs in \d+ s$", out, re.M)
