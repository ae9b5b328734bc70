"""Repeated jobs (`sweep.repeats=N`, issue 30): each job of a sweep run N times, interleaved.

Single runs of the same job moved 10-20% in step time on the shared machines tfmemlab runs
on; a ratio to the baseline from one run each cannot tell a real cost from noise. So each job
runs N times, each in a fresh process, and the comparison gives each ratio an interval
(runner/core/bootstrap.py).

- **Interleaved:** at the sweep's start the key `sweep.repeat=0,...,N-1` is put first among
  Hydra's sweeper params. Hydra's basic sweeper takes the product of its keys with the first
  outermost, so the jobs run A B C A B C ...: drift in the machine's load hits every job
  alike. Hydra job `num` is repeat `num // J` of job `num % J` (J jobs).
- **In MLflow:** each job gets a run of its own under the sweep's parent, created at the
  sweep's start (`jobs.json` in the sweep folder lists them); its repeats are its children,
  tagged `repeat=i` and `repeat_of=<job run>`. At the end the job's run gets its repeats'
  params and, for each figure, their median, with `<key>_lo`/`<key>_hi` (their p10 and p90)
  for the figures the comparison divides: the runs table shows one row per job.
- `sweep.resume` plans each repeat by its own folder, like any job (runner/sweep/resume.py).
"""

import json
import time
from pathlib import Path

from mlflow.entities import Metric, Param, Run
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, open_dict, read_write

from runner.cli import job_overrides
from runner.core.bootstrap import median, spread
from runner.track.spread import repeats

JOBS_FILE = "jobs.json"
KEY = "sweep.repeat"
BASIC = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# The figures whose spread the job's run keeps as <key>_lo / <key>_hi.
SPREAD = ("mem/peak_bytes", "speed/step_time_s_p50", "speed/samples_per_s")
# Tags a job's run takes from its first finished repeat: what the comparison reads.
CARRIED = ("device_name", "mem/source", "figures_cover_steps", "model_uri")


def order_repeats(config: DictConfig) -> None:
    """Put `sweep.repeat=0..N-1` first among the sweeper's params (module docstring); nothing
    is changed for N = 1."""
    n = config.sweep.repeats
    sweeper = config.hydra.sweeper
    params = dict(sweeper.get("params") or {})
    if n == 1 or KEY in params:  # a resumed sweep's config may have it already
        return
    if sweeper.get("_target_") != BASIC:
        raise SystemExit(
            f"error: sweep.repeats={n}: interleaving needs Hydra's basic sweeper; "
            f"this sweep uses {sweeper.get('_target_')}"
        )
    with read_write(config), open_dict(config):
        sweeper.params = {KEY: ",".join(str(i) for i in range(n)), **params}


def job_names(config: DictConfig) -> list[str]:
    """Each job's overrides, as one line, in Hydra's order (sweep.repeat left out)."""
    params = dict(config.hydra.sweeper.get("params") or {})
    params.pop(KEY, None)
    task = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    return [" ".join(o for o in job if not o.startswith(f"{KEY}=")) for job in job_overrides(task)]


def create_job_runs(
    client: MlflowClient, experiment: str, parent_id: str, sweep_dir: Path, config: DictConfig
) -> None:
    """One run per job under the parent, before any repeat starts, listed in jobs.json."""
    jobs = []
    for num, name in enumerate(job_names(config)):
        tags = {"mlflow.parentRunId": parent_id, "sweep_id": parent_id, "job_num": str(num)}
        tags["repeats"] = str(config.sweep.repeats)
        run = client.create_run(experiment, run_name=name or "default", tags=tags)
        jobs.append({"job_num": num, "run_id": run.info.run_id, "overrides": name})
    (sweep_dir / JOBS_FILE).write_text(json.dumps(jobs, indent=2))


def read_jobs(sweep_dir: Path) -> list[dict]:
    """The job runs of a sweep with repeats (jobs.json), or [] for a sweep without."""
    path = sweep_dir / JOBS_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def job_of(job_dir: Path, num: int) -> dict:
    """The job (its entry in jobs.json) that Hydra job `num`, in folder `job_dir`, repeats.
    jobs.json is looked for above the job's folder, not in hydra.sweep.dir: that would be
    resolved again here (its ${now:...} at another time)."""
    for folder in job_dir.parents[:3]:
        jobs = read_jobs(folder)
        if jobs:
            return jobs[num % len(jobs)]
    raise SystemExit(f"error: no {JOBS_FILE} above {job_dir}: the sweep's job runs are unknown")


def aggregate(client: MlflowClient, sweep_dir: Path) -> None:
    """At the sweep's end: each job's run gets its repeats' params, the median of each figure
    they all logged and the p10/p90 of those in SPREAD; FINISHED when every repeat finished,
    else FAILED with the first failure and `repeats_finished=k/N`."""
    for job in read_jobs(sweep_dir):
        run = client.get_run(job["run_id"])
        runs = repeats(client, run)
        done = [r for r in runs if r.info.status == "FINISHED"]
        want = int(run.data.tags["repeats"])
        client.set_tag(run.info.run_id, "repeats_finished", f"{len(done)}/{want}")
        if done:
            _log_figures(client, run, done)
        if len(done) == want:
            client.set_terminated(run.info.run_id, status="FINISHED")
            continue
        failed = [r for r in runs if r.info.status == "FAILED"]
        if failed:
            client.set_tag(run.info.run_id, "failure", failed[0].data.tags.get("failure", "error"))
        client.set_terminated(run.info.run_id, status="FAILED" if failed or not done else "KILLED")


def _log_figures(client: MlflowClient, run: Run, done: list[Run]) -> None:
    first = done[0].data
    if not run.data.params:  # the repeats' config (the same but for sweep.repeat)
        params = [Param(k, v) for k, v in first.params.items() if k != KEY]
        for i in range(0, len(params), 100):  # MLflow takes 100 params a batch
            client.log_batch(run.info.run_id, params=params[i : i + 100])
    for tag in CARRIED:
        if tag in first.tags:
            client.set_tag(run.info.run_id, tag, first.tags[tag])
    keys = set.intersection(*(set(r.data.metrics) for r in done))
    now = int(1000 * time.time())
    metrics = []
    for key in sorted(keys):
        values = [r.data.metrics[key] for r in done]
        metrics.append(Metric(key, median(values), now, 0))
        if key in SPREAD:
            lo, hi = spread(values)
            metrics += [Metric(f"{key}_lo", lo, now, 0), Metric(f"{key}_hi", hi, now, 0)]
    for i in range(0, len(metrics), 1000):
        client.log_batch(run.info.run_id, metrics=metrics[i : i + 1000])


def mark_stopped(client: MlflowClient, sweep_dir: Path, status: str) -> None:
    """The sweep stopped (a signal) or goes on (resumed): its unfinished job runs say so."""
    for job in read_jobs(sweep_dir):
        if client.get_run(job["run_id"]).info.status != "FINISHED":
            client.update_run(job["run_id"], status=status)
