"""How far a ratio of two jobs' figures can be trusted: a percentile bootstrap over repeats.

A sweep with `sweep.repeats=N` runs each job N times (runner/sweep/repeats.py), interleaved:
round i runs repeat i of every job back to back. A job's figure is the median of its repeats,
and its ratio to the baseline the ratio of the two medians. Its interval: resample the rounds
with replacement, keeping each round's two runs together, take the ratio of the two jobs'
medians over the resampled rounds, and repeat RESAMPLES times; the 2.5th and 97.5th percentiles
of those ratios are the 95% interval (Efron and Tibshirani, An Introduction to the Bootstrap;
the rounds are resampled as pairs). Pairing is what the interleaving is for: a round the
machine was busy in slows both jobs, and resampling the jobs apart would pair one job's slow
round with the other's fast one (measured: `blocks` against `none`, rounds 1.20-1.38x, read as
[0.698, 2.33] resampled apart). Where the two jobs share fewer than two finished rounds, each
job's repeats are resampled on their own. The generator's seed is fixed, so the same repeats
always give the same interval.

A ratio whose interval holds 1 is *within noise*: the repeats cannot tell it from no change.
With few repeats (5) a percentile bootstrap of a median is coarse and somewhat too narrow
(its interval lies between observed values): treat a ratio just outside noise with care.
With one repeat on either side there is no interval, and none is made up.
"""

import numpy as np

RESAMPLES = 4000
LEVEL = 0.95
SEED = 30  # fixed: the same repeats give the same interval, run after run


def median(values: list[float]) -> float:
    return float(np.median(values))


def spread(values: list[float]) -> tuple[float, float]:
    """The repeats' p10 and p90: how far one run of the job strays from another."""
    lo, hi = np.percentile(values, [10, 90])
    return float(lo), float(hi)


def ratio_interval(
    job: list[float], base: list[float], paired: bool = False
) -> tuple[float, float] | None:
    """The 95% percentile-bootstrap interval of median(job) / median(base); None unless both
    have at least two repeats. paired: job[i] and base[i] ran in the same round and are
    resampled together (module docstring); else each list is resampled on its own."""
    if len(job) < 2 or len(base) < 2:
        return None
    if paired and len(job) != len(base):
        raise ValueError(f"paired repeats of unequal length: {len(job)} and {len(base)}")
    rng = np.random.default_rng(SEED)
    a, b = np.asarray(job, float), np.asarray(base, float)
    rows = rng.integers(0, len(a), (RESAMPLES, len(a)))
    num = np.median(a[rows], axis=1)
    den = np.median(b[rows if paired else rng.integers(0, len(b), (RESAMPLES, len(b)))], axis=1)
    tail = 100 * (1 - LEVEL) / 2
    lo, hi = np.percentile(num / den, [tail, 100 - tail])
    return float(lo), float(hi)


def within_noise(interval: tuple[float, float] | None) -> bool | None:
    """True when the interval holds 1 (no change cannot be ruled out); None without one."""
    if interval is None:
        return None
    return interval[0] <= 1.0 <= interval[1]
