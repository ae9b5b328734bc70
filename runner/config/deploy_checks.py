"""The checks of the `deploy` group (runner/deploy/, issue 49): its variants, batch size,
threads and counts, each bad value one line before TensorFlow loads. deploy=none checks nothing
of it: a run that measures no deployment is not stopped by its keys."""

from omegaconf import DictConfig

from runner.config.schema import DEPLOY_NAMES, DEPLOY_VARIANTS
from runner.core.errors import ConfigError


def _at_least(key: str, value, low: int, kind: str = "an integer") -> None:
    if value is None or isinstance(value, bool) or value < low:
        raise ConfigError(key, value, f"{kind} >= {low}")


def check_deploy(d: DictConfig, save_model: bool = True) -> None:
    """Raise ConfigError for the first bad value of the deploy group `d`; save_model: the
    run's trainer.save_model (deploy measures the model the run keeps)."""
    if d.name not in DEPLOY_NAMES:
        raise ConfigError("deploy.name", d.name, "one of " + ", ".join(DEPLOY_NAMES))
    if d.name == "none":
        return
    allowed = "a non-empty list of " + ", ".join(DEPLOY_VARIANTS)
    if not d.variants:
        raise ConfigError("deploy.variants", "[]", allowed)
    for variant in d.variants:
        if variant not in DEPLOY_VARIANTS:
            raise ConfigError("deploy.variants", variant, allowed)
    _at_least("deploy.batch_size", d.batch_size, 1)
    if d.threads is not None:
        _at_least("deploy.threads", d.threads, 1)
    _at_least("deploy.calibration_batches", d.calibration_batches, 1)
    _at_least("deploy.repeats", d.repeats, 1)
    _at_least("deploy.warmup", d.warmup, 0)
    _at_least("deploy.warmup_s", d.warmup_s, 0, "seconds")
    _at_least("deploy.min_time_s", d.min_time_s, 0, "seconds")
    _at_least("deploy.rounds", d.rounds, 1)
    if not save_model:
        why = f"true with deploy={d.name} (it measures the model the run keeps)"
        raise ConfigError("trainer.save_model", save_model, why)
