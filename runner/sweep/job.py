"""A sweep's job: run in a fresh process of its own (sweep.isolate), told what a resumed sweep
does with it, and stopped with the sweep.

TensorFlow keeps memory for the life of a process, and in-process jobs were measured charged
for earlier ones (a small job's peak rose from 36.0 to 52.3 MB after a larger job): a fresh
process per job makes every job's figures its own.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner.core.errors import BusyError
from runner.sweep.callback import stop
from runner.sweep.repeats import KEY as REPEAT_KEY
from runner.sweep.repeats import job_of
from runner.sweep.resume import JobPlan, plan_job
from runner.sweep.state import (
    JOB_ENV,
    JOB_RUN_ENV,
    KEY,
    PARENT_ENV,
    REPEAT_ENV,
    SWEEP_PID_ENV,
    sweep_of_job,
)
from runner.track.rundir import run_name

RUN_PY = Path(__file__).resolve().parents[2] / "run.py"


def run_isolated(cfg: DictConfig, resume_from: Path | None) -> None:
    """Run this sweep job as a plain run in a fresh Python process, and wait for it. The
    child records its run (FINISHED, or FAILED with its `failure` tag) under the sweep's
    parent run.

    The child has a session of its own, so a Ctrl-C reaches the sweep's process only: the
    first SIGINT or SIGTERM is passed on as SIGTERM (the job ends its step, checkpoints and
    stops), a second SIGINT as SIGINT (it stops at once); then the sweep stops too, and
    `sweep.resume` goes on with it. If the sweep's process dies, the child gets SIGTERM.
    """
    hydra_cfg = HydraConfig.get()
    task = [o for o in hydra_cfg.overrides.task if not o.startswith(f"{KEY}=")]
    env = {**os.environ, JOB_ENV: str(hydra_cfg.job.num), SWEEP_PID_ENV: str(os.getpid())}
    name = cfg.mlflow.run_name or run_name([o for o in task if not o.startswith(f"{REPEAT_KEY}=")])
    if cfg.sweep.repeats > 1:  # a child of its job's run (runner/sweep/repeats.py)
        env[JOB_RUN_ENV] = job_of(Path(hydra_cfg.runtime.output_dir), hydra_cfg.job.num)["run_id"]
        env[REPEAT_ENV] = str(cfg.sweep.repeat)
        name += f" (repeat {cfg.sweep.repeat})"
    # A user's --config-dir (its model YAML, say) joins the child's search path as well.
    user_dirs = [
        s.path.removeprefix("file://")
        for s in hydra_cfg.runtime.config_sources
        if s.provider == "command-line" and s.schema == "file"
    ]
    args = [
        sys.executable,
        str(RUN_PY),
        *[arg for d in user_dirs for arg in ("--config-dir", d)],
        *task,
        # A plain run: a preset that sets hydra.mode=MULTIRUN (experiment=memory_study)
        # must not make the child sweep again.
        "hydra.mode=RUN",
        f"hydra.run.dir={hydra_cfg.runtime.output_dir}",
        f"mlflow.run_name='{name}'",
        *([f"trainer.resume={resume_from}"] if resume_from else []),
    ]
    sweep = sweep_of_job()
    if sweep is not None and sweep["tracking_uri"] is not None:  # from sweep.json: a Ray
        env[PARENT_ENV] = sweep["parent_run_id"]  # cluster's worker has not the sweep's env
        env["MLFLOW_TRACKING_URI"] = sweep["tracking_uri"]
    child = subprocess.Popen(args, env=env, start_new_session=True)
    received: list[int] = []

    def pass_on(signum, frame) -> None:
        child.send_signal(signal.SIGTERM if not received else signal.SIGINT)
        received.append(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        stop(cfg.mlflow.tracking_uri, received[0])
    if returncode == BusyError.exit_code:  # its folder is another process's (said above)
        print(f"tfmemlab: job {hydra_cfg.job.num} not run", file=sys.stderr)
    elif returncode != 0:  # the sweep goes on; the job's MLflow run holds the error
        print(
            f"tfmemlab: job {hydra_cfg.job.num} failed (exit {returncode}); its "
            "MLflow run has the error and a failure tag",
            file=sys.stderr,
        )


def plan_sweep_job() -> JobPlan:
    """In a resumed sweep (sweep.resume): what this job does, said before it does it."""
    hydra_cfg = HydraConfig.get()
    plan = plan_job(Path(hydra_cfg.runtime.output_dir))
    verb = {
        "run": "runs",
        "skip": "skipped",
        "busy": "left to it",
        "resume": "goes on from its last checkpoint",
        "rerun": "runs again, in a new run",
    }[plan.action]
    print(f"tfmemlab: job {hydra_cfg.job.num}: {plan.reason}: {verb}", flush=True)
    return plan
