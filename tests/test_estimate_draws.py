"""The estimate on jobs drawn at random from the whole configurable space (issue 29): every
family and version, shapes, batch, precision, checkpointing policy, dropout and accum, each
draw in a fresh process as a user runs it, within issue 15's band. A failing seed is a bug in
the estimate's rules, not a draw to exclude."""

import os

import pytest

from runner.bench import draws, estimate
from tests.conftest import ESTIMATE_SEED

DRAWS = 2  # the suite's budget: 3 took 116 s in CI (2026-12-07), 4 up to 192, 6 191-194
# A new seed each run (tests/conftest.py chooses it, and prints it in the run's header), so
# that the suite draws from the whole space over its runs, not the same jobs (seed 29's were the
# ones the rules were read off first). TFMEMLAB_ESTIMATE_SEED=S draws a run's jobs again (as
# does the benchmark's `python -m runner.bench estimate --draws N --seed S`).
SEED = int(os.environ[ESTIMATE_SEED])


def test_draws_are_reproducible_and_within_the_budget():
    jobs = draws.draws(20, SEED, draws.SMALL)
    assert jobs == draws.draws(20, SEED, draws.SMALL)
    assert jobs != draws.draws(20, SEED + 1, draws.SMALL)
    for knobs in jobs:
        if knobs["model"] == "transformer":
            assert knobs["model.h"] % knobs["model.heads"] == 0
        overrides = draws.overrides(knobs)
        assert "trainer.max_steps=3" in overrides


def test_a_peak_within_the_bound_part_of_its_estimate_is_what_the_estimate_says():
    # 60 MiB measured of an estimate of 100 of which 50 are a bound (a recurrent layer's
    # products run ahead): between 0.85 x 50 and 115, ok; without the bound, a miss.
    band = (0.85, 1.15)
    result = {"mem/measured_over_estimate": 0.6, "mem/estimate_bytes": 100}
    assert draws.verdict(result, band) == (0.6, "MISSED")
    bounded = {**result, "mem/estimate_bound_bytes": 50}
    assert draws.verdict(bounded, band) == (0.6, "ok (in its bound)")
    assert draws.verdict({**bounded, "mem/measured_over_estimate": 0.4}, band)[1] == "MISSED"
    assert draws.verdict({**bounded, "mem/measured_over_estimate": 1.2}, band)[1] == "MISSED"


# slow: a fresh process a draw; 6 draws took 163 s of CPU (11.7 min of wall time at a load of 7)
# and 143 s in the whole suite: process start, tracing and XLA compilation are most of it; 5
# draws took 89 s in CI (6 took 191-194 s on 2026-12-07, a CI run at 25.9 min in all, over its
# 25). The benchmark's --draws 60 is the wider check.
@pytest.mark.slow
def test_the_estimate_holds_on_jobs_drawn_at_random(capsys):
    jobs = draws.draws(DRAWS, SEED, draws.SMALL)
    rows = estimate.drawn(jobs, SEED, ["trainer.progress=false"], draws.SMALL)
    # ok: in the band, or, where part of the estimate is a bound (a recurrent layer's
    # products run ahead), between the estimate without it and the whole (draws.verdict)
    outside = {row["draw"]: row for row in rows if not row["verdict"].startswith("ok")}
    if outside:
        # As the calibration matrix's test: the executor's order of independent ops moves a
        # peak between runs, so a draw outside the band is measured once more, in a fresh
        # process, and must be in it then. A rule that is wrong misses twice.
        again = estimate.drawn([jobs[i] for i in outside], SEED, ["trainer.progress=false"])
        outside = {
            i: (row, second)
            for (i, row), second in zip(outside.items(), again, strict=True)
            if not second["verdict"].startswith("ok")
        }
    printed = capsys.readouterr().out
    print(printed)  # the seed and the table, in the test's output
    assert f"seed {SEED}:" in printed
    assert not outside, (f"seed {SEED}", outside)


# Loss-scaled transformers under XLA that accumulate. Seed 988575's draw 1, which CI drew (5
# layers, h=60, vocabulary 1682, micro-batch 4, accum 4): its micro-batch call adds the scaled
# gradients into their sums, and their quotients by the scale are made in the update's own
# call, beside no activation (runner/techniques/accumulation.py). It peaked at 13.85 MiB: 0.934
# of the estimate with one copy of the gradients there, 0.842 with two (as an accum=1 step
# holds). Seed 388292's draw 10 (the suite's draws, 1 layer, h=168, vocabulary 3996, micro-batch
# 1, chunked) peaks in that update call, whose XLA plan holds two copies of every gradient
# (xla_fitted.update_call_bytes): 1.085 with the call weighed, 1.246 without.
MISSED = {
    "seed 988575 draw 1": {
        "model": "transformer", "model.h": 60, "model.layers": 5, "model.heads": 5,
        "data.seq_len": 30, "data.vocab_size": 1682, "model.attention": "standard",
        "model.dropout": 0.0, "data.batch_size": 4, "accum": 4, "precision": "mixed",
        "checkpointing": "none",
    },
    "seed 388292 draw 10": {
        "model": "transformer", "model.h": 168, "model.layers": 1, "model.heads": 8,
        "data.seq_len": 25, "data.vocab_size": 3996, "model.attention": "chunked",
        "model.attention_block": 128, "model.dropout": 0.1, "data.batch_size": 1, "accum": 4,
        "precision": "mixed", "checkpointing": "none",
    },
}  # fmt: skip


@pytest.mark.slow  # one fresh process each
@pytest.mark.parametrize("job", list(MISSED))
def test_an_accumulating_loss_scaled_step_is_weighed_at_both_of_its_calls(job):
    result = estimate.run_draw(MISSED[job], ["trainer.progress=false"])
    low, high = estimate.BAND
    assert low <= result["mem/measured_over_estimate"] <= high, result
