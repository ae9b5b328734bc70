"""Each variant measured `deploy.rounds` times, round-robin, and what the rounds say together.

Round r measures every variant once, in order, each in a fresh process (runner/deploy/child.py),
so that a spell in which the machine is busy slows every variant of that round alike. A
variant's figure is the median of its rounds. Its latency ratio to float32 LiteRT is the ratio
of the two medians, with a 95% bootstrap interval over the rounds, resampled in pairs (the
variant's and float32's measurement of the same round together: runner/core/bootstrap.py). One
round gives no interval, and none is made up. A ratio whose interval holds 1 is within noise.
"""

from collections.abc import Callable

from runner.core.bootstrap import median, ratio_interval, within_noise
from runner.core.errors import error_line

# The figures that vary from round to round: each row keeps their medians.
VARYING = (
    "load_ms", "rss_growth_bytes", "tf_peak_bytes", "latency_b1_p50_ms", "latency_b1_p90_ms",
    "latency_batch_p50_ms", "latency_batch_p90_ms",
)  # fmt: skip
# The latencies compared with float32 LiteRT's: (figure, the ratio's name).
RATIOS = (("latency_b1_p50_ms", "b1_vs_float32"), ("latency_batch_p50_ms", "batch_vs_float32"))
BASE = "float32"


def measure(jobs: dict[str, Callable[[], dict]], rounds: int) -> dict[str, list[dict] | str]:
    """Each job (a variant's measurement in a fresh process) run `rounds` times, round-robin;
    per variant its rounds' figures in order, or the one-line reason a round failed (that
    variant is not measured again)."""
    out: dict[str, list[dict] | str] = {name: [] for name in jobs}
    for _ in range(rounds):
        for name, job in jobs.items():
            if isinstance(out[name], str):
                continue
            try:
                out[name].append(job())
            except Exception as err:  # the runtime refused the file: the others go on
                out[name] = f"not measured: {error_line(err)}"[:300]
    return out


def combine(rounds: list[dict]) -> dict:
    """One row from a variant's rounds: the first round's outputs and file digest (every round
    must have measured the same file), the medians of the figures that vary, and the rounds'
    latencies (`per_round`) for the ratios' intervals."""
    digests = {r["sha256"] for r in rounds}
    if len(digests) > 1:
        raise RuntimeError(f"the rounds measured different files: {sorted(digests)}")
    row = {k: v for k, v in rounds[0].items() if k not in VARYING and k != "pid"}
    for key in VARYING:
        values = [r[key] for r in rounds if r.get(key) is not None]
        row[key] = median(values) if values else None
    row["rounds"] = len(rounds)
    row["per_round"] = {key: [r[key] for r in rounds] for key, _ in RATIOS}
    return row


def add_ratios(rows: dict[str, dict]) -> None:
    """Each measured LiteRT variant's latency ratios to float32 LiteRT (`<ratio>`), with their
    intervals over the rounds (`<ratio>_lo`, `_hi`) when there are two rounds or more."""
    base = rows.get(BASE, {})
    if "per_round" not in base:
        return
    for name, row in rows.items():
        if name in (BASE, "saved_model") or "per_round" not in row:
            continue
        for key, ratio in RATIOS:
            row[ratio] = row[key] / base[key]
            interval = ratio_interval(row["per_round"][key], base["per_round"][key], paired=True)
            if interval is not None:
                row[f"{ratio}_lo"], row[f"{ratio}_hi"] = interval


def ratio_text(row: dict, ratio: str) -> str:
    """`0.36x float32 [0.33, 0.40]` (with `, within noise` when the interval holds 1), or
    `0.36x float32` with one round; "" where there is no ratio."""
    if row.get(ratio) is None:
        return ""
    text = f"{row[ratio]:.2f}x {BASE}"
    lo, hi = row.get(f"{ratio}_lo"), row.get(f"{ratio}_hi")
    if lo is None:
        return text
    noise = ", within noise" if within_noise((lo, hi)) else ""
    return f"{text} [{lo:.2f}, {hi:.2f}]{noise}"
