"""tfmemlab entry point: `python run.py precision=mixed accum=4`, `python run.py -m ...`.

The command line is checked (one line for bad input) before Hydra and TensorFlow start; then
each job is, in order: a resumed sweep's decision about it, a fresh process of its own in a
sweep (sweep.isolate), accum=auto's measured choice, and the training pipeline.
"""

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from runner.cli import check_command_line
from runner.config import name_model, register_configs
from runner.core.diskfull import disk_full
from runner.core.errors import (
    BusyError,
    ConfigError,
    DiskFull,
    Interrupted,
    ModelError,
    NonFiniteLoss,
    PlanError,
    ResumeError,
    TrackingError,
)
from runner.core.secrets import redact
from runner.core.start import import_tensorflow
from runner.launch import LAUNCH_ENV
from runner.sweep.resume import resume_argv
from runner.sweep.state import JOB_ENV, die_with_sweep, sweep_tags
from runner.track.server import sqlite_path

register_configs()


def _sweep_job(cfg: DictConfig) -> bool:
    """In a sweep's process: run this job apart, or leave it (a resumed sweep's finished or
    busy job); True when it is done with. An in-process job of a resumed sweep is set to go
    on from its checkpoint."""
    # Here, not at the top: it imports MLflow (about 1.5 s), which the command line's check
    # comes before.
    from runner.sweep.job import plan_sweep_job, run_isolated

    resume_from = None
    if cfg.sweep.resume:
        plan = plan_sweep_job()
        if plan.action in ("skip", "busy"):
            return True
        if plan.action == "resume":
            resume_from = Path(HydraConfig.get().runtime.output_dir)
    if cfg.sweep.isolate:
        run_isolated(cfg, resume_from)
        return True
    if resume_from is not None:
        with open_dict(cfg):
            cfg.trainer.resume = str(resume_from)
    return False


def _train(cfg: DictConfig) -> None:
    """accum=auto's choice (probes in fresh processes, before this process allocates), then
    the pipeline, under the sweep this job belongs to, if any."""
    from runner.train.pipeline import run

    record = None
    if cfg.accum == "auto" and not cfg.trainer.resume:
        from runner.plan.auto import auto

        cfg, record = auto(cfg)
    run(cfg, sweep_tags(), record)


def _one_job(cfg: DictConfig) -> None:
    """A plain run: what stops it is said in one line."""
    import tensorflow as tf

    try:
        _train(cfg)
    except (TrackingError, PlanError, ModelError) as err:  # the store, the budget, the model
        raise SystemExit(f"error: {err}") from None
    except ConfigError as err:  # found when the data is built (a custom function's error): FAILED
        raise SystemExit(f"error: {err}") from None
    except BusyError as err:  # another process has the run directory: nothing was changed
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(err.exit_code) from None
    # FAILED: failure=disk_full, no checkpoint restores, or failure=nan (the step, whether the
    # data held it, what to try)
    except (DiskFull, ResumeError, NonFiniteLoss) as err:
        raise SystemExit(f"error: {err}") from None
    except tf.errors.ResourceExhaustedError as err:  # the run is FAILED (failure=oom)
        full = disk_full(err)  # any that training did not name (TensorFlow's words)
        raise SystemExit(f"error: {full or err.message}") from None
    except Exception as err:  # a write of the run on a full disk (MLflow may wrap the OSError)
        full = disk_full(err, sqlite_path(cfg.mlflow.tracking_uri))
        if full is None:
            raise
        raise SystemExit(f"error: {full}") from None
    except Interrupted as err:  # checkpointed, the run marked KILLED: say how to go on
        if JOB_ENV in os.environ or LAUNCH_ENV in os.environ:  # the sweep or the launch
            print(f"tfmemlab: {err}", flush=True)
        else:
            print(
                redact(f"tfmemlab: {err}; go on with: python run.py trainer.resume={err.run_dir}")
            )
        raise SystemExit(err.exit_code) from None


def _in_sweep(cfg: DictConfig) -> None:
    """A job run in the sweep's process: its failure is recorded and the sweep goes on; a
    signal stops the sweep too."""
    from runner.sweep.callback import stop
    from runner.track.lifecycle import failure_kind

    try:
        _train(cfg)
    except Interrupted as err:  # checkpointed, the run marked KILLED
        stop(cfg.mlflow.tracking_uri, err.signum)
    except BusyError as err:  # its folder is another process's: the job was not run
        print(f"tfmemlab: job {HydraConfig.get().job.num} not run: {err}", file=sys.stderr)
    except Exception as err:  # recorded FAILED (with its `failure` tag)
        print(
            f"tfmemlab: job {HydraConfig.get().job.num} failed ({failure_kind(err)}): "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            file=sys.stderr,
        )


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    name_model(cfg)  # a `_target_` model without a name: its target's (runner/config/model.py)
    in_child = JOB_ENV in os.environ  # already the fresh process of an isolated job
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN and not in_child
    if multirun and _sweep_job(cfg):
        return
    print(
        f"tfmemlab: job {redact(' '.join(HydraConfig.get().overrides.task)) or 'default'}",
        flush=True,
    )
    import_tensorflow()
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        _in_sweep(cfg)
    else:
        _one_job(cfg)


if __name__ == "__main__":
    die_with_sweep()
    sys.argv[1:] = resume_argv(sys.argv[1:])
    check_command_line(sys.argv[1:])
    main()
