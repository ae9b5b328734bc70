"""tfmemlab entry point: `python run.py precision=mixed accum=4`, `python run.py -m ...`."""

import os
import subprocess
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.cli import check_command_line
from runner.config import register_configs

register_configs()


def run_isolated(cfg: DictConfig) -> None:
    """Run this sweep job as a plain run in a fresh Python process, and wait for it.

    TensorFlow keeps memory for the life of a process, and in-process jobs were measured
    charged for earlier ones (a small job's peak rose from 36.0 to 52.3 MB after a larger
    job): a fresh process per job makes every job's figures its own. The child records its
    run (FINISHED, or FAILED with its `failure` tag) under the sweep's parent run.
    """
    from runner.track.tracking import JOB_ENV

    hydra_cfg = HydraConfig.get()
    name = cfg.mlflow.run_name or " ".join(hydra_cfg.overrides.task) or "default"
    args = [
        sys.executable,
        str(Path(__file__).resolve()),
        *hydra_cfg.overrides.task,
        # A plain run: a preset that sets hydra.mode=MULTIRUN (experiment=memory_study)
        # must not make the child sweep again.
        "hydra.mode=RUN",
        f"hydra.run.dir={hydra_cfg.runtime.output_dir}",
        f"mlflow.run_name='{name}'",
    ]
    child = subprocess.run(args, env={**os.environ, JOB_ENV: str(hydra_cfg.job.num)})
    if child.returncode != 0:  # the sweep goes on; the job's MLflow run holds the error
        print(
            f"tfmemlab: job {hydra_cfg.job.num} failed (exit {child.returncode}); its "
            "MLflow run has the error and a failure tag",
            file=sys.stderr,
        )


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    # Imported here so that --help, --cfg and bad input answer before TensorFlow loads.
    from runner.track.tracking import JOB_ENV

    in_child = JOB_ENV in os.environ  # already the fresh process of an isolated job
    if HydraConfig.get().mode == RunMode.MULTIRUN and cfg.sweep.isolate and not in_child:
        run_isolated(cfg)
        return
    from runner import import_tensorflow_quietly

    print(f"tfmemlab: job {' '.join(HydraConfig.get().overrides.task) or 'default'}", flush=True)
    import_tensorflow_quietly()
    from runner.resume import Interrupted
    from runner.track.server import TrackingError
    from runner.train import run

    if HydraConfig.get().mode != RunMode.MULTIRUN:
        try:
            run(cfg)
        except TrackingError as err:  # the store cannot be used: one line, no run to lose
            raise SystemExit(f"error: {err}") from None
        except Exception as err:  # out of memory: the run is FAILED (failure=oom); one line
            if type(err).__name__ != "ResourceExhaustedError":
                raise
            raise SystemExit(f"error: {err.message}") from None
        except Interrupted as err:  # checkpointed, the run marked KILLED: say how to go on
            print(f"tfmemlab: {err}; go on with: python run.py trainer.resume={err.run_dir}")
            raise SystemExit(err.exit_code) from None
        return
    try:
        run(cfg)
    except Exception as err:  # recorded FAILED (with its `failure` tag): the sweep goes on
        from runner.track.tracking import failure_kind

        print(
            f"tfmemlab: job {HydraConfig.get().job.num} failed ({failure_kind(err)}): "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    check_command_line(sys.argv[1:])
    main()
