"""`python -m runner.deploy RUN [deploy.KEY=VALUE ...]`: measure a run already trained where
its model would run, and log the figures into that same run (runner/deploy/job.py).

    python -m runner.deploy outputs/runs/2026-12-06/10-00-00
    python -m runner.deploy runs:/RUN_ID --tracking-uri sqlite:///outputs/mlflow.db
    python -m runner.deploy models:/MODEL_ID --tracking-uri sqlite:///outputs/mlflow.db
    python -m runner.deploy outputs/runs/2026-12-06/10-00-00 deploy.variants=[float32,int8]

RUN is a run directory, runs:/RUN_ID, or models:/MODEL_ID (the model_uri tag of the run that
logged it; or models:/NAME/VERSION of a registered model): the run's directory must be on this
machine, since the model measured is its model.keras. The settings are
conf/deploy/litert.yaml's (the run's own when it ran with deploy=litert) with the overrides
given. A run that kept no model, a key that does
not exist or a bad value is one line, before TensorFlow loads.
"""

import argparse
import sys

from runner.core.errors import ConfigError
from runner.deploy.target import DeployTargetError, locate


def command_line() -> argparse.ArgumentParser:
    """The command line of `python -m runner.deploy`."""
    parser = argparse.ArgumentParser(
        prog="python -m runner.deploy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", help="a run directory, runs:/<run id> or models:/<model id>")
    parser.add_argument("overrides", nargs="*", help="deploy.KEY=VALUE, as run.py takes them")
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="the store of runs:/ and models:/ (a run directory names its own in run.json)",
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    """Measure the run's kept model and log the figures into its run; returns them."""
    args = command_line().parse_intermixed_args(argv)  # overrides before or after options
    try:
        target = locate(args.run, args.tracking_uri, args.overrides)
    except (DeployTargetError, ConfigError) as err:
        raise SystemExit(f"error: {err}") from None
    from runner.core.start import import_tensorflow

    import_tensorflow()  # quietly, before what follows imports it
    import keras

    from runner.deploy.job import measure_kept
    from runner.track.client import client_for
    from runner.track.tracker import Tracker

    client = client_for(target.tracking_uri)
    run = client.get_run(target.run_id)
    tracker = Tracker(client, target.run_id, run.info.experiment_id, run.info.run_name)
    # The job's seed, as the run set it: the calibration batches are the job's own first ones.
    keras.utils.set_random_seed(target.config.trainer.seed)
    figures = measure_kept(target.config, tracker, target.run_dir)
    tracker.flush()
    print(f"tfmemlab: deploy: logged into run {target.run_id} ({target.run_dir})", flush=True)
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
