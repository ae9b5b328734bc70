"""The estimate on jobs drawn at random from the whole configurable space (issue 29): every
family and version, shapes, batch, precision, checkpointing policy, dropout and accum, each
draw in a fresh process as a user runs it, within issue 15's band. A failing seed is a bug in
the estimate's rules, not a draw to exclude."""

import os
import random

import pytest

from runner.bench import draws, estimate

DRAWS = 6
# A new seed each run (tests/conftest.py chooses it, and prints it in the run's header), so
# that the suite draws from the whole space over its runs, not the same jobs (seed 29's were the
# ones the rules were read off first). TFMEMLAB_ESTIMATE_SEED=S draws a run's jobs again (as
# does the benchmark's `python -m runner.bench estimate --draws N --seed S`).
SEED = int(os.environ.get("TFMEMLAB_ESTIMATE_SEED") or random.SystemRandom().randrange(10**6))


def test_draws_are_reproducible_and_within_the_budget():
    jobs = draws.draws(20, SEED, draws.SMALL)
    assert jobs == draws.draws(20, SEED, draws.SMALL)
    assert jobs != draws.draws(20, SEED + 1, draws.SMALL)
    for knobs in jobs:
        if knobs["model"] == "transformer":
            assert knobs["model.h"] % knobs["model.heads"] == 0
        overrides = draws.overrides(knobs)
        assert "trainer.max_steps=3" in overrides


# slow: a fresh process a draw; 6 draws took 163 s of CPU (11.7 min of wall time at a load of 7)
# and 143 s in the whole suite: process start, tracing and XLA compilation are most of it; 5
# draws took 89 s in CI. The benchmark's --draws 60 is the wider check.
@pytest.mark.slow
def test_the_estimate_holds_on_jobs_drawn_at_random(capsys):
    jobs = draws.draws(DRAWS, SEED, draws.SMALL)
    rows = estimate.drawn(jobs, SEED, ["trainer.progress=false"], draws.SMALL)
    low, high = estimate.BAND
    outside = {
        row["draw"]: row for row in rows if not low <= (row["measured/estimate"] or 0) <= high
    }
    if outside:
        # As the calibration matrix's test: the executor's order of independent ops moves a
        # peak between runs, so a draw outside the band is measured once more, in a fresh
        # process, and must be in it then. A rule that is wrong misses twice.
        again = estimate.drawn([jobs[i] for i in outside], SEED, ["trainer.progress=false"])
        outside = {
            i: (row, second)
            for (i, row), second in zip(outside.items(), again, strict=True)
            if not low <= (second["measured/estimate"] or 0) <= high
        }
    printed = capsys.readouterr().out
    print(printed)  # the seed and the table, in the test's output
    assert f"seed {SEED}:" in printed
    assert not outside, (f"seed {SEED}", outside)
