"""Hydra's side of the config: the schemas stored under their base_* names, the conf/ folder,
and composing it outside a Hydra app (tests, benchmarks, the planner)."""

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from runner.config.data_schema import DataConfig
from runner.config.model import name_model
from runner.config.schema import (
    CheckpointingConfig,
    Config,
    DeployConfig,
    DistributionConfig,
    EfficientNetConfig,
    KerasAppConfig,
    MobileNetConfig,
    PrecisionConfig,
    TrainerConfig,
    TransformerConfig,
)
from runner.core.lock import fresh_dir
from runner.schedules import SCHEDULES

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def group_options(group: str) -> list[str]:
    """The options of a config group: its YAML files (the base_* schemas are not options)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _groups_help() -> str:
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
    return "\n".join(f"{g}: {', '.join(group_options(g))}" for g in groups)


def register_configs() -> None:
    """Store the schemas under the names the YAML defaults lists extend (base_<option>).

    Also registers the `tfmemlab_groups` resolver used by --help (Hydra's own group list
    would show the base_* schemas as if they were options) and `tfmemlab_fresh_dir`, which
    names the run and sweep folders.
    """
    OmegaConf.register_new_resolver("tfmemlab_groups", _groups_help, replace=True)
    # A run's or sweep's folder of its own, though Hydra names it by the second
    OmegaConf.register_new_resolver("tfmemlab_fresh_dir", fresh_dir, replace=True, use_cache=True)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, name, node in [
        ("model", "base_transformer", TransformerConfig),
        ("model", "base_mobilenet", MobileNetConfig),
        ("model", "base_efficientnet", EfficientNetConfig),
        ("model", "base_keras_app", KerasAppConfig),
        ("precision", "base_precision", PrecisionConfig),
        ("checkpointing", "base_checkpointing", CheckpointingConfig),
        ("distribution", "base_distribution", DistributionConfig),
        ("deploy", "base_deploy", DeployConfig),
        ("trainer", "base_trainer", TrainerConfig),
    ]:
        cs.store(group=group, name=name, node=node)
    # Every pruning schedule's and data source's schema, under the name its YAML extends: a new
    # one needs no line here.
    for name, node in SCHEDULES.items():
        cs.store(group="pruning", name=f"base_{name}", node=node)
    for node in DataConfig.__subclasses__():
        cs.store(group="data", name=f"base_{node.name}", node=node)


def search_path(config_dir: str | Path | None) -> list[str]:
    """The override that adds a user's config folder (`--config-dir`) to conf/'s search path."""
    if config_dir is None:
        return []
    return [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]


def compose_config(overrides: list[str], config_dir: str | Path | None = None) -> DictConfig:
    """The real conf/ composed with these overrides, outside a Hydra app (tests, benchmarks);
    config_dir: a user's config folder beside it, as `python run.py --config-dir DIR` adds."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, *search_path(config_dir)])
    return name_model(cfg)


def with_batch(cfg: DictConfig, b: int, accum: int, **more) -> DictConfig:
    """A resolved copy of cfg at micro-batch b and accum, with `more` (dotted keys) set."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    out.data.batch_size, out.accum = b, accum
    for key, value in more.items():
        OmegaConf.update(out, key, value, merge=False)
    return out


def with_option(cfg: DictConfig, group: str, option: str) -> DictConfig:
    """A resolved copy of cfg with conf/<group>/<option>.yaml in place of its option."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    out[group] = OmegaConf.merge(out[group], OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
    return out
