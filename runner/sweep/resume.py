"""Sweeps that resume (issue 16): `python run.py -m sweep.resume=<sweep dir>|latest`.

Hydra has no resume for sweeps (facebookresearch/hydra#3328). At the start of a sweep,
tfmemlab's sweep callback writes `sweep.json` into the sweep directory (runner/sweep/state.py):
the parent MLflow run, the store and the sweep's overrides. `sweep.resume` launches the same
sweep again, into the same directory and under the same parent run, so that job N finds its own
folder
(`<sweep dir>/N`) and what its last attempt left there. Before it starts, each job looks:

- its run FINISHED: the job is skipped;
- its run was stopped (KILLED by a signal, or left RUNNING by a process that is gone) after
  a checkpoint: the job goes on from that checkpoint, in the same MLflow run
  (`trainer.resume=<job dir>`);
- its run FAILED, or was stopped with no checkpoint to go on from: the job runs again, in a
  new MLflow run. The last attempt's files move to `<job dir>/attempts/<run id>/`, and its
  run is tagged `superseded`, so the comparison covers each job once;
- it has no run: it runs.

The command line is rewritten here before Hydra starts (no TensorFlow, no MLflow): the
sweep's overrides are filled in when none are given, and checked when they are, since
Hydra numbers the jobs by their order.
"""

import json
import socket
from dataclasses import dataclass
from pathlib import Path

from hydra._internal.utils import get_args_parser

from runner.core.errors import BusyError, ResumeError
from runner.core.lock import LOCK_FILE, check_free, holder
from runner.core.process import pid_alive
from runner.sweep.state import KEY, SWEEP_FILE, read_sweep_file
from runner.track.rundir import RUN_FILE, locate, newest_folder

ATTEMPTS = "attempts"


def _latest_sweep(task: list[str], root: Path = Path("outputs")) -> Path:
    """The newest sweep directory under `root`; of these overrides, when some are given."""
    found = newest_folder(
        root, SWEEP_FILE, lambda record, folder: not task or record.get("overrides") == task
    )
    if found is None:
        which = f" of the overrides '{' '.join(task)}'" if task else ""
        raise SystemExit(f"error: {KEY}=latest: no sweep{which} under {root}/ to resume")
    return found


def resume_argv(argv: list[str]) -> list[str]:
    """The command line that relaunches the sweep `sweep.resume=` names; argv itself when it
    names none. Exits with a one-line error when the sweep cannot be resumed as asked."""
    values = [a.partition("=")[2] for a in argv if a.startswith(f"{KEY}=")]
    if not values or values[-1] in ("", "null"):
        return argv

    args = get_args_parser().parse_args(argv)
    overrides = set(args.overrides)
    flags = [a for a in argv if a not in overrides]  # -m, --config-name NAME, ...
    task = [o for o in args.overrides if not o.lstrip("+~").startswith(("hydra", f"{KEY}="))]
    hydra = [o for o in args.overrides if o.lstrip("+~").startswith("hydra")]
    sweep_dir = _latest_sweep(task) if values[-1] == "latest" else Path(values[-1])
    try:  # a sweep still running, or resumed already: nothing is planned nor moved
        check_free(sweep_dir, f"{KEY}={values[-1]}")
    except BusyError as err:
        raise SystemExit(f"error: {err}") from None
    record = read_sweep_file(sweep_dir)
    if task and task != record["overrides"]:
        raise SystemExit(
            f"error: {KEY}={values[-1]}: that sweep ran '{' '.join(record['overrides'])}'; "
            "give the same overrides in the same order (jobs are numbered by it), or none"
        )
    hydra = [o for o in hydra if not o.startswith("hydra.sweep.dir=")] or record["hydra_overrides"]
    if not args.multirun:
        flags.insert(0, "-m")
    return [
        *flags,
        *hydra,
        *record["overrides"],
        f"{KEY}={sweep_dir}",
        f"hydra.sweep.dir={sweep_dir}",
    ]


@dataclass
class JobPlan:
    action: str  # run | skip | resume | rerun | busy
    reason: str
    run_id: str | None = None


def plan_job(job_dir: Path) -> JobPlan:
    """What a relaunched sweep does with the job whose folder is `job_dir` (module docstring).
    A job it runs again has its last attempt moved aside and its run tagged `superseded`."""
    held = holder(job_dir)  # e.g. a trainer.resume of this job's folder
    if held is not None:
        return JobPlan("busy", f"its folder is held by process {held['pid']} on {held['host']}")
    try:
        record = json.loads((job_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return JobPlan("run", "it has no run yet")
    run_id = record["run_id"]
    # Here, not at the top: run.py imports resume_argv before it checks the command line, and
    # MLflow's import (about 1.5 s) would come before every one-line error.
    from runner.track.client import client_for

    client = client_for(record["tracking_uri"])
    try:
        run = client.get_run(run_id)
    except Exception:  # not in the store (deleted): nothing to go on from there
        _move_aside(job_dir, run_id)
        return JobPlan("rerun", f"its run {run_id} is not in {record['tracking_uri']}")
    status, tags = run.info.status, run.data.tags
    if status == "FINISHED":
        return JobPlan("skip", f"its run {run_id} FINISHED", run_id)
    gone = True
    if status == "RUNNING" and tags.get("host") == socket.gethostname() and "pid" in tags:
        gone = not pid_alive(int(tags["pid"]))
    if status == "RUNNING" and not gone:
        return JobPlan("busy", f"its run {run_id} is still running (process {tags['pid']})", run_id)
    if status == "FAILED":
        why = f"its run {run_id} FAILED ({tags.get('failure', 'error')})"
    else:
        try:
            locate(str(job_dir), [])
        except ResumeError as err:
            why = f"its run {run_id} was stopped ({status}), and {str(err).partition(': ')[2]}"
        else:
            return JobPlan("resume", f"its run {run_id} was stopped ({status})", run_id)
    if status == "RUNNING":  # left so by a process that is gone
        client.set_tag(run_id, "lost", "its process is gone; the job ran again (sweep.resume)")
        client.set_terminated(run_id, status="KILLED")
    client.set_tag(run_id, "superseded", "the job ran again in a new run (sweep.resume)")
    _move_aside(job_dir, run_id)
    return JobPlan("rerun", why, run_id)


def _move_aside(job_dir: Path, run_id: str) -> None:
    """Move the last attempt's files (run.json, checkpoints, figures) into attempts/<run id>/;
    Hydra's own (.hydra, the job's log) stay."""
    dest = job_dir / ATTEMPTS / run_id
    dest.mkdir(parents=True, exist_ok=True)
    for path in job_dir.iterdir():
        if path.name in (".hydra", ATTEMPTS, LOCK_FILE) or path.suffix == ".log":
            continue
        path.rename(dest / path.name)
