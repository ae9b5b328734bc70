"""Which run `python -m runner.deploy` measures, read without TensorFlow: a run directory (its
`run.json` names the MLflow run, the store and the resolved config), `runs:/RUN_ID` (the
run's `run_dir` tag names its directory) or `models:/MODEL_ID` (the run that logged that
model); whether it kept a model; and the deploy settings,
the run's own (deploy=litert) or conf/deploy/litert.yaml's, with the command's overrides.
Each thing that cannot be used is one line (DeployTargetError) before TensorFlow loads."""

import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.config import CONF_DIR
from runner.config.deploy_checks import check_deploy
from runner.config.schema import DeployConfig
from runner.track.rundir import RUN_FILE

# The files runner/track/model.py keeps in a run directory (FILE, WEIGHTS there; named here so
# that the check runs before TensorFlow loads, which that module imports; a test keeps them equal)
FILE, WEIGHTS = "model.keras", "model.weights.h5"


class DeployTargetError(ValueError):
    """The run named cannot be measured: `str(err)` is the one line shown."""


@dataclass
class Target:
    run_dir: Path
    run_id: str
    tracking_uri: str
    config: DictConfig  # the run's resolved config, its deploy group as measured


def no_model(run_dir: Path) -> str | None:
    """Why the run in `run_dir` has no model to measure (one line), or None."""
    if (run_dir / FILE).is_file():
        return None
    if (run_dir / WEIGHTS).is_file():
        return f"{run_dir} kept its weights only ({WEIGHTS}: a model Keras cannot save whole)"
    return (
        f"{run_dir} kept no model ({FILE}): it ran with trainer.save_model=false, or failed "
        "or was stopped before its last step"
    )


def _run_dir_of(uri: str, run_id: str) -> Path:
    """The directory of the run `run_id` in the store at `uri` (its run_dir tag)."""
    from mlflow.exceptions import MlflowException

    from runner.track.client import client_for

    try:
        run = client_for(uri).get_run(run_id)
    except MlflowException as err:
        raise DeployTargetError(f"runs:/{run_id}: {str(err.message).splitlines()[0]}") from None
    folder = run.data.tags.get("run_dir")
    if folder is None or not Path(folder).is_dir():
        where = f"its run directory {folder} is not on this machine" if folder else "no run_dir"
        raise DeployTargetError(f"runs:/{run_id}: {where}; give the run directory instead")
    return Path(folder)


def _run_of_model(uri: str, given: str) -> str:
    """The run that logged the model `given` names: models:/MODEL_ID (MLflow 3's logged model,
    what a run's model_uri tag says) or models:/NAME/VERSION (a registered model's version)."""
    from mlflow.exceptions import MlflowException

    from runner.track.client import client_for

    name = given.removeprefix("models:/").strip("/")
    client = client_for(uri)
    try:
        if "/" in name:
            registered, version = name.rsplit("/", 1)
            run_id = client.get_model_version(registered, version).run_id
        else:
            run_id = client.get_logged_model(name).source_run_id
    except MlflowException as err:
        raise DeployTargetError(f"{given}: {str(err.message).splitlines()[0]}") from None
    if not run_id:
        raise DeployTargetError(f"{given}: the model names no run that logged it")
    return run_id


def deploy_settings(run_deploy, overrides: list[str]) -> DictConfig:
    """conf/deploy/litert.yaml's settings, the run's own when it measured with deploy=litert,
    then `overrides` (deploy.KEY=VALUE); checked as run.py checks them."""
    base = OmegaConf.structured(DeployConfig)
    litert = OmegaConf.load(CONF_DIR / "deploy" / "litert.yaml")
    litert.pop("defaults", None)
    merged = OmegaConf.merge(base, litert)
    if run_deploy is not None and run_deploy.get("name") == "litert":
        merged = OmegaConf.merge(merged, run_deploy)
    for override in overrides:
        key, _, value = override.partition("=")
        if not key.startswith("deploy.") or not value:
            raise DeployTargetError(f"{override}: expected deploy.KEY=VALUE, e.g. deploy.threads=2")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{key[7:]}={value}"]))
        except Exception as err:  # a key the group lacks, a value of the wrong type
            raise DeployTargetError(f"{override}: {str(err).splitlines()[0]}") from None
    check_deploy(merged)
    return merged


def locate(given: str, tracking_uri: str | None, overrides: list[str]) -> Target:
    """The run `given` names (a run directory, runs:/RUN_ID or the models:/ URI of the model it
    logged), with a model to measure."""
    if given.startswith(("runs:/", "models:/")):
        if tracking_uri is None:
            raise DeployTargetError(f"{given}: give the store with --tracking-uri")
        if given.startswith("runs:/"):
            run_id = given.removeprefix("runs:/").split("/")[0]
        else:
            run_id = _run_of_model(tracking_uri, given)
        run_dir = _run_dir_of(tracking_uri, run_id)
    else:
        run_dir = Path(given)
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise DeployTargetError(f"{given}: no {RUN_FILE} there; expected a run directory")
    why = no_model(run_dir)
    if why is not None:
        raise DeployTargetError(why)
    record = json.loads(path.read_text())
    config = OmegaConf.create(record["config"])
    config.deploy = deploy_settings(config.get("deploy"), overrides)
    uri = tracking_uri or record["tracking_uri"]
    return Target(run_dir, record["run_id"], uri, config)
