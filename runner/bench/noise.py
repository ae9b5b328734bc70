"""A benchmark's ratios with their noise: `--repeats N`, each ratio's interval, the verdicts.

With `--repeats N` a benchmark runs its jobs in N interleaved rounds (round r runs every job
once, in order; runner/bench/__init__.py `run_rounds`). A job's figure is the median of its
repeats, a ratio the ratio of two jobs' medians, and its interval the paired percentile
bootstrap over the rounds of runner/core/bootstrap.py (docs/sweeps.md, "Repeats and noise"),
each round's two runs resampled together. Every target here is an upper bound (`ratio <=
target`), so a verdict is taken on the interval's far end, its `hi`: a target the median meets
but `hi` does not is "met only within noise". With one repeat there is no interval, and the
verdict is on the single ratio.
"""

from typing import NamedTuple

from runner.core.bootstrap import median, ratio_interval, within_noise

OK, NOISE, MISSED = "ok", "met only within noise", "MISSED"


class Ratio(NamedTuple):
    """median(job) / median(base), and its 95% interval (None with one repeat)."""

    value: float
    interval: tuple[float, float] | None = None

    @property
    def far(self) -> float:
        """The end of the interval furthest from meeting an upper-bound target."""
        return self.value if self.interval is None else self.interval[1]

    def __str__(self) -> str:
        if self.interval is None:
            return f"{self.value:.3f}"
        lo, hi = self.interval
        within = " within noise" if within_noise(self.interval) else ""
        return f"{self.value:.3f} [{lo:.3f}, {hi:.3f}]{within}"


def ratio(job: list[dict], base: list[dict], key: str) -> Ratio:
    """The ratio of two jobs' figure `key` over their repeats, round i of each paired."""
    a, b = [r[key] for r in job], [r[key] for r in base]
    return Ratio(median(a) / median(b), ratio_interval(a, b, paired=True))


def medians(runs: list[dict]) -> dict:
    """A job's figures: the median over its repeats of each number they all report."""
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    return {k: median([r[k] for r in runs]) for k in keys if all(k in r for r in runs)}


def verdict(checks: list[tuple[Ratio, float]]) -> str:
    """OK when every ratio's far end is within its target, NOISE when only the medians are,
    else MISSED."""
    if all(r.far <= target for r, target in checks):
        return OK
    if all(r.value <= target for r, target in checks):
        return NOISE
    return MISSED


def note(repeats: int) -> str:
    """The line under a benchmark's table: what the brackets are, or that there are none."""
    if repeats == 1:
        return (
            "No intervals: each job ran once (--repeats 1), so the verdicts are on single "
            "ratios, and single runs' step times moved 10-20% here; --repeats 5 gives each "
            "ratio an interval."
        )
    return (
        f"[lo, hi]: 95% bootstrap interval of the ratio of medians over {repeats} interleaved "
        "rounds (each round's two runs resampled together); 'within noise': it holds 1; "
        f"verdicts on hi, the far end: '{NOISE}' where the median meets the target and hi "
        "does not."
    )


def take_repeats(args: list[str], default: int = 1) -> tuple[int, list[str]]:
    """(N from `--repeats N`, else `default`; the other arguments)."""
    return _take_count("--repeats", args, default)


def take_rounds(args: list[str], default: int) -> tuple[int, list[str]]:
    """(N from `--rounds N`, else `default`; the other arguments)."""
    return _take_count("--rounds", args, default)


def take_steps(args: list[str], default: int) -> tuple[int, list[str]]:
    """(S from `--steps S`, else `default`; the other arguments)."""
    return _take_count("--steps", args, default)


def _take_count(flag: str, args: list[str], default: int) -> tuple[int, list[str]]:
    count, rest, it = default, [], iter(args)
    for arg in it:
        if arg != flag:
            rest.append(arg)
            continue
        value = next(it, None)
        if value is None or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"error: {flag} {value}: expected a whole number >= 1")
        count = int(value)
    return count, rest
