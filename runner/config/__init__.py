"""The job's config: its schema (schema), Hydra's store and conf/ (store), and the checks
Hydra's types cannot express (validate). TensorFlow-free: bad input is answered before it loads.
"""

from runner.config.model import name_model, takes_images
from runner.config.schema import IMAGE_MODELS, MlflowConfig
from runner.config.store import (
    CONF_DIR,
    compose_config,
    group_options,
    register_configs,
    with_batch,
    with_option,
)
from runner.config.validate import validate
from runner.core.errors import ConfigError

__all__ = [
    "CONF_DIR",
    "IMAGE_MODELS",
    "ConfigError",
    "MlflowConfig",
    "compose_config",
    "group_options",
    "name_model",
    "register_configs",
    "takes_images",
    "validate",
    "with_batch",
    "with_option",
]
