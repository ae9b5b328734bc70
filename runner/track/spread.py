"""A job's repeats (sweep.repeats, runner/sweep/repeats.py) and what they say of the comparison.

A job of a sweep with repeats has a run of its own, whose children are its repeats (tag
`repeat_of`); any other run is its own one repeat.
"""

from mlflow.entities import Run
from mlflow.tracking import MlflowClient


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
