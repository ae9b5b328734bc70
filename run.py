"""tfmemlab entry point: `python run.py precision=mixed accum=4`, `python run.py -m ...`."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from runner.cli import check_command_line
from runner.config import register_configs
from runner.sweep_resume import JobPlan, die_with_sweep, resume_argv

register_configs()


def run_isolated(cfg: DictConfig, resume_from: Path | None) -> None:
    """Run this sweep job as a plain run in a fresh Python process, and wait for it.

    TensorFlow keeps memory for the life of a process, and in-process jobs were measured
    charged for earlier ones (a small job's peak rose from 36.0 to 52.3 MB after a larger
    job): a fresh process per job makes every job's figures its own. The child records its
    run (FINISHED, or FAILED with its `failure` tag) under the sweep's parent run.

    The child has a session of its own, so a Ctrl-C reaches the sweep's process only: the
    first SIGINT or SIGTERM is passed on as SIGTERM (the job ends its step, checkpoints and
    stops), a second SIGINT as SIGINT (it stops at once); then the sweep stops too, and
    `sweep.resume` goes on with it. If the sweep's process dies, the child gets SIGTERM.
    """
    from runner.sweep_resume import KEY, SWEEP_PID_ENV
    from runner.track.tracking import JOB_ENV, PARENT_ENV, sweep_of_job

    hydra_cfg = HydraConfig.get()
    task = [o for o in hydra_cfg.overrides.task if not o.startswith(f"{KEY}=")]
    name = cfg.mlflow.run_name or " ".join(task) or "default"
    args = [
        sys.executable,
        str(Path(__file__).resolve()),
        *task,
        # A plain run: a preset that sets hydra.mode=MULTIRUN (experiment=memory_study)
        # must not make the child sweep again.
        "hydra.mode=RUN",
        f"hydra.run.dir={hydra_cfg.runtime.output_dir}",
        f"mlflow.run_name='{name}'",
        *([f"trainer.resume={resume_from}"] if resume_from else []),
    ]
    env = {**os.environ, JOB_ENV: str(hydra_cfg.job.num), SWEEP_PID_ENV: str(os.getpid())}
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
        from runner.track.sweep import stop

        stop(cfg.mlflow.tracking_uri, received[0])
    if returncode != 0:  # the sweep goes on; the job's MLflow run holds the error
        print(
            f"tfmemlab: job {hydra_cfg.job.num} failed (exit {returncode}); its "
            "MLflow run has the error and a failure tag",
            file=sys.stderr,
        )


def plan_sweep_job() -> JobPlan:
    """In a resumed sweep (sweep.resume): what this job does, said before it does it."""
    from runner.sweep_resume import plan_job

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


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    # Imported here so that --help, --cfg and bad input answer before TensorFlow loads.
    from runner.track.tracking import JOB_ENV

    in_child = JOB_ENV in os.environ  # already the fresh process of an isolated job
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN and not in_child
    resume_from = None
    if multirun and cfg.sweep.resume:
        plan = plan_sweep_job()
        if plan.action in ("skip", "busy"):
            return
        if plan.action == "resume":
            resume_from = Path(HydraConfig.get().runtime.output_dir)
    if multirun and cfg.sweep.isolate:
        run_isolated(cfg, resume_from)
        return
    if resume_from is not None:  # an in-process job of a resumed sweep goes on from there
        with open_dict(cfg):
            cfg.trainer.resume = str(resume_from)
    from runner import import_tensorflow_quietly

    print(f"tfmemlab: job {' '.join(HydraConfig.get().overrides.task) or 'default'}", flush=True)
    import_tensorflow_quietly()
    from runner.launch import LAUNCH_ENV
    from runner.resume import Interrupted
    from runner.track.server import TrackingError
    from runner.train import run

    if HydraConfig.get().mode != RunMode.MULTIRUN:
        try:
            run(cfg)
        except TrackingError as err:  # the store cannot be used: one line, no run to lose
            raise SystemExit(f"error: {err}") from None
        except Exception as err:  # out of memory: the run is FAILED (failure=oom); one line
            if type(err).__name__ == "PlanError":  # accum=auto: the budget cannot be met
                raise SystemExit(f"error: {err}") from None
            if type(err).__name__ != "ResourceExhaustedError":
                raise
            raise SystemExit(f"error: {err.message}") from None
        except Interrupted as err:  # checkpointed, the run marked KILLED: say how to go on
            if JOB_ENV in os.environ or LAUNCH_ENV in os.environ:  # the sweep or the launch
                print(f"tfmemlab: {err}", flush=True)
            else:
                print(f"tfmemlab: {err}; go on with: python run.py trainer.resume={err.run_dir}")
            raise SystemExit(err.exit_code) from None
        return
    try:
        run(cfg)
    except Interrupted as err:  # checkpointed, the run marked KILLED: the sweep stops too
        from runner.track.sweep import stop

        stop(cfg.mlflow.tracking_uri, err.signum)
    except Exception as err:  # recorded FAILED (with its `failure` tag): the sweep goes on
        from runner.track.tracking import failure_kind

        print(
            f"tfmemlab: job {HydraConfig.get().job.num} failed ({failure_kind(err)}): "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    die_with_sweep()
    sys.argv[1:] = resume_argv(sys.argv[1:])
    check_command_line(sys.argv[1:])
    main()
