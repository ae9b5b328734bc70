"""A job's repeats (sweep.repeats, runner/sweep/repeats.py) and what they say of the comparison.

A job of a sweep with repeats has a run of its own, whose children are its repeats (tag
`repeat_of`); any other run is its own one repeat.
"""

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from runner.core.bootstrap import ratio_interval, spread, within_noise
from runner.core.text import cell


def repeats(client: MlflowClient, job_run: Run) -> list[Run]:
    """A job run's repeats, by repeat number: the newest run of each, never a superseded one;
    a run that is no job of a sweep with repeats is its own one repeat."""
    if "repeats" not in job_run.data.tags:
        return [job_run]
    runs = client.search_runs(
        [job_run.info.experiment_id], f"tags.repeat_of = '{job_run.info.run_id}'"
    )
    newest = {}
    for run in sorted(runs, key=lambda r: r.info.start_time):
        if "superseded" not in run.data.tags:
            newest[int(run.data.tags["repeat"])] = run
    return [newest[i] for i in sorted(newest)]


def finished(client: MlflowClient, runs: list[Run]) -> list[list[Run]]:
    """Each run's finished repeats: what its figures and their intervals come from."""
    return [[r for r in repeats(client, run) if r.info.status == "FINISHED"] for run in runs]


def by_round(runs: list[Run], key: str, scale: float = 1.0) -> dict[int, float]:
    """The metric `key` (times `scale`) of each run that logged it, by round (its `repeat`
    tag; a run without one is its own round i)."""
    return {
        int(r.data.tags.get("repeat", i)): r.data.metrics[key] * scale
        for i, r in enumerate(runs)
        if key in r.data.metrics
    }


def add_intervals(out: list[dict], values: list[dict], base: int | None, ratios) -> None:
    """Beside each ratio to the baseline (column `<c>/base`, a ratio of medians), its 95%
    bootstrap interval (`<c>/base_lo`, `_hi`) and verdict (`<c>/base_noise`: within noise,
    beyond noise, or no interval), and the job's own spread over its repeats (`<c>_lo`, `_hi`:
    p10 and p90). `values[i][c]` maps row i's rounds (repeat numbers) to its repeats' values
    of figure c."""
    for i, row in enumerate(out):
        row["repeats"] = max((len(v) for v in values[i].values()), default=0)
        for c in ratios:
            have = values[i].get(c, {})
            row[f"{c}_lo"], row[f"{c}_hi"] = (
                spread(list(have.values())) if len(have) > 1 else (None, None)
            )
            interval = None
            if base is not None and i != base and row[f"{c}/base"] is not None:
                interval = interval_of(have, values[base].get(c, {}))
            row[f"{c}/base_lo"], row[f"{c}/base_hi"] = interval or (None, None)
            noise = within_noise(interval)
            row[f"{c}/base_noise"] = {True: NOISE, False: BEYOND, None: ""}[noise]
            if noise is None and i != base and row[f"{c}/base"] is not None:
                row[f"{c}/base_noise"] = NONE


def interval_of(job: dict, base: dict) -> tuple[float, float] | None:
    """Paired over the rounds both jobs finished, when there are two or more (bootstrap.py);
    else each job's repeats resampled on their own."""
    rounds = sorted(job.keys() & base.keys())
    if len(rounds) >= 2:
        return ratio_interval([job[r] for r in rounds], [base[r] for r in rounds], paired=True)
    return ratio_interval(list(job.values()), list(base.values()))


NOISE, BEYOND, NONE = "within noise", "beyond noise", "no interval"
HIDDEN = ("_lo", "_hi", "/base_noise")  # in the CSV; the table's ratio cell says them


def ratio_cell(row: dict, column: str) -> str:
    """`1.146 [1.02, 1.29]`, `0.998 [0.97, 1.03] within noise`, or the ratio alone."""
    ratio, lo, hi = (row[f"{column}/base{end}"] for end in ("", "_lo", "_hi"))
    if ratio is None or lo is None:
        return cell(ratio)
    text = f"{ratio:.4g} [{lo:.3g}, {hi:.3g}]"
    return text + (f" {NOISE}" if row[f"{column}/base_noise"] == NOISE else "")


def notes(out: list[dict], ratios) -> list[str]:
    """What the intervals are, or why there are none; how exact peak memory was."""
    verdicts = {row.get(f"{c}/base_noise") for row in out for c in ratios} - {"", None}
    if not verdicts:
        return []
    if verdicts == {NONE}:
        return [
            "No intervals: each job ran once (sweep.repeats=1), so how much of a ratio is noise "
            "is unknown (single runs of one job moved 10-20% in step time on a shared CPU); "
            "sweep.repeats=5 gives each ratio an interval."
        ]
    counts = sorted({row["repeats"] for row in out if row["repeats"]})
    lines = [
        f"[lo, hi]: the ratio's 95% bootstrap interval over the jobs' repeats ("
        f"{'/'.join(map(str, counts))} each; the rounds resampled, each round's runs of the two "
        f"jobs kept together; ratio of medians); '{NOISE}': it holds 1, so the repeats cannot "
        "tell that figure from the baseline's."
    ]
    widths = [
        (row["peak_MiB_hi"] - row["peak_MiB_lo"]) / row["peak_MiB"]
        for row in out
        if row.get("peak_MiB_lo") is not None and row["peak_MiB"]
    ]
    if widths:
        lines.append(
            f"Peak memory: one job's repeats differed by up to {100 * max(widths):.2g}% "
            "(p10-p90)" + (", nearly exact." if max(widths) < 0.01 else ".")
        )
    return lines


def job_note(row: dict, ratios) -> str:
    """A job's run's description: its repeats and its ratios to the baseline, each with its
    interval and whether it is within noise."""
    lines = [
        f"tfmemlab: job '{row['job']}': {row['repeats']} repeats, interleaved with the "
        "sweep's other jobs, each in a fresh process; its figures are their medians"
    ]
    for c in ratios:
        if row.get(f"{c}/base") is not None:
            lines.append(f"  {c}/base {ratio_cell(row, c)}")
    return "\n".join(lines)
