"""A sweep's state: sweep.json in its folder, and what a job learns of the sweep it belongs to.

At the start of a sweep, tfmemlab's sweep callback (runner/sweep/callback.py) creates the
parent MLflow run, writes `sweep.json` into the sweep directory (the parent run, the store
and the sweep's overrides: what `sweep.resume` needs) and hands the parent's id to the jobs
through the environment (PARENT_ENV), which their processes inherit (joblib, submitit, a Ray
instance the sweep starts; sbatch passes it on). A job run in a fresh process of its own
(sweep.isolate) also gets its job number (JOB_ENV) and the sweep's pid (SWEEP_PID_ENV).
`sweep_tags()` turns that into the tags that make the job's run a child of the parent; the
run's tracker is handed them (runner.track.lifecycle.mlflow_run), and never reads sweep state.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

from runner.core.secrets import redact, redact_obj

SWEEP_FILE = "sweep.json"
KEY = "sweep.resume"
PARENT_ENV = "TFMEMLAB_PARENT_RUN_ID"  # set by the sweep callback for the jobs of a sweep
JOB_ENV = "TFMEMLAB_JOB_NUM"  # set for a sweep job run in a fresh process (runner/sweep/job.py)
SWEEP_PID_ENV = "TFMEMLAB_SWEEP_PID"  # set for a job run in a process of its own
# Set for a repeat of a job (sweep.repeats > 1, runner/sweep/repeats.py): its job's run, its number.
JOB_RUN_ENV = "TFMEMLAB_JOB_RUN_ID"
REPEAT_ENV = "TFMEMLAB_REPEAT"


def write_sweep_file(
    sweep_dir: Path, parent_id: str, uri: str, experiment: str, task: list[str], hydra: list[str]
) -> None:
    """Record the sweep at its start: what `sweep.resume` needs to launch it again."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "parent_run_id": parent_id,
        "tracking_uri": uri,
        "experiment": experiment,
        "overrides": [o for o in task if not o.startswith(f"{KEY}=")],
        # Hydra's own overrides (a launcher, say), less those a resume sets itself.
        "hydra_overrides": [
            o for o in hydra if not o.startswith(("hydra.sweep.dir=", "hydra.mode="))
        ],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    # The store's URI without its login: a resumed sweep or a Ray worker takes it from
    # MLFLOW_TRACKING_USERNAME/PASSWORD (issue 27).
    (sweep_dir / SWEEP_FILE).write_text(json.dumps(redact_obj(record), indent=2))


def read_sweep_file(sweep_dir: Path) -> dict:
    path = sweep_dir / SWEEP_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        raise SystemExit(
            f"error: {KEY}={sweep_dir}: no readable {SWEEP_FILE} there; expected the "
            "directory of a tfmemlab sweep (outputs/multirun/<date>/<time>)"
        ) from None


def resume_command(sweep_dir: Path) -> str:
    return redact(f"python run.py -m {KEY}={sweep_dir}")


def sweep_of_job() -> dict | None:
    """The sweep this job belongs to ({"parent_run_id", "tracking_uri"}), or None.

    The parent comes from the environment (module docstring); the job's own config then names
    the store (tracking_uri None). The workers of a Ray cluster started apart (`ray start`,
    hydra.launcher.ray.init.address) have neither the sweep's environment nor its
    MLFLOW_TRACKING_URI: they read both from the sweep folder's sweep.json.
    """
    if os.environ.get(PARENT_ENV):
        return {"parent_run_id": os.environ[PARENT_ENV], "tracking_uri": None}
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    # The job's folder is sweep.dir/subdir. Not sweep.dir itself: its ${now:...} would be
    # resolved again in the worker, at another time.
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    for folder in [job_dir, *job_dir.parents][:4]:
        try:
            record = json.loads((folder / SWEEP_FILE).read_text())
            return {k: record[k] for k in ("parent_run_id", "tracking_uri")}
        except (OSError, ValueError, KeyError):
            continue
    return None


def sweep_tags() -> dict[str, str]:
    """Tags that make this job's run a child of its sweep's parent run, with its job number;
    a repeat's run is a child of its job's run instead, tagged `repeat`; none outside a
    sweep."""
    sweep = sweep_of_job()
    if sweep is None:
        return {}
    parent = sweep["parent_run_id"]
    from hydra.core.hydra_config import HydraConfig

    tags = {"mlflow.parentRunId": parent, "sweep_id": parent}
    if JOB_ENV in os.environ:  # a job run in a process of its own (sweep.isolate)
        tags["job_num"] = os.environ[JOB_ENV]
    elif HydraConfig.initialized():
        tags["job_num"] = str(HydraConfig.get().job.num)
    if os.environ.get(JOB_RUN_ENV):
        job_run = os.environ[JOB_RUN_ENV]
        tags.update({"mlflow.parentRunId": job_run, "repeat_of": job_run})
        tags["repeat"] = os.environ[REPEAT_ENV]
    return tags


def die_with_sweep() -> None:
    """In a job run in a process of its own: get SIGTERM when the sweep's process dies, even by
    SIGKILL, so the job ends its step, checkpoints and marks its run KILLED instead of going
    on alone (Linux: PR_SET_PDEATHSIG)."""
    sweep_pid = os.environ.get(SWEEP_PID_ENV)
    if sweep_pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(sweep_pid):  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)
