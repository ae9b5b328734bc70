"""The bootstrap behind a sweep's intervals (runner/core/bootstrap.py), without TensorFlow."""

import numpy as np
import pytest

from runner.core.bootstrap import median, ratio_interval, spread, within_noise

# Step times of five repeats, as a shared CPU gives them (seconds; made up for the test).
BASE = [0.100, 0.104, 0.098, 0.111, 0.101]


def test_no_interval_from_one_repeat_on_either_side():
    assert ratio_interval([0.2], BASE) is None
    assert ratio_interval(BASE, [0.1]) is None
    assert within_noise(None) is None  # said as such, not as within or beyond noise


def test_the_same_repeats_give_the_same_interval():
    job = [0.103, 0.099, 0.108, 0.100, 0.097]
    assert ratio_interval(job, BASE) == ratio_interval(job, BASE)


def test_an_a_a_pair_is_within_noise_and_a_real_cost_beyond_it():
    same = [0.103, 0.099, 0.108, 0.100, 0.097]  # the baseline's spread, another draw
    lo, hi = ratio_interval(same, BASE)
    assert lo < 1 < hi and within_noise((lo, hi))
    slower = [1.3 * t for t in [0.103, 0.099, 0.108, 0.100, 0.097]]
    lo, hi = ratio_interval(slower, BASE)
    assert 1 < lo <= median(slower) / median(BASE) <= hi and not within_noise((lo, hi))


def test_the_interval_resamples_both_jobs():
    # A steady baseline: the interval's width is the job's own noise, and a noisy baseline
    # widens it further.
    job = [0.09, 0.10, 0.11, 0.10, 0.12]
    steady = ratio_interval(job, [0.1] * 5)
    noisy = ratio_interval(job, [0.08, 0.10, 0.12, 0.10, 0.09])
    assert steady[1] - steady[0] < noisy[1] - noisy[0]
    assert ratio_interval([0.1] * 5, [0.1] * 5) == (1.0, 1.0)  # exact figures: no spread


def test_the_interval_is_the_percentiles_of_resampled_ratios_of_medians():
    job, base = [0.2, 0.25, 0.22], [0.1, 0.12]
    rng = np.random.default_rng(30)
    a = np.median(np.asarray(job)[rng.integers(0, 3, (4000, 3))], axis=1)
    b = np.median(np.asarray(base)[rng.integers(0, 2, (4000, 2))], axis=1)
    assert ratio_interval(job, base) == pytest.approx(tuple(np.percentile(a / b, [2.5, 97.5])))


def test_spread_is_p10_to_p90():
    assert spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((1.4, 4.6))


def test_paired_rounds_see_a_real_difference_that_load_drift_hides_from_independent_ones():
    # Each round's load slows both jobs alike (rounds 2 and 4 busy); the job is 1.2-1.3x the
    # baseline in every round, as `blocks` against `none` measured round by round.
    base = [0.104, 0.218, 0.110, 0.168, 0.106]
    job = [b * r for b, r in zip(base, [1.38, 1.28, 1.27, 1.29, 1.20], strict=True)]
    lo, hi = ratio_interval(job, base, paired=True)
    assert 1.19 < lo < hi < 1.39  # beyond noise, within the rounds' own ratios
    apart = ratio_interval(job, base)
    assert apart[0] < 1 < apart[1]  # resampled apart, the drift swamps it


def test_paired_repeats_must_be_rounds_of_both_jobs():
    with pytest.raises(ValueError, match="unequal"):
        ratio_interval([0.1, 0.2, 0.3], [0.1, 0.2], paired=True)
