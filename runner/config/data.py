"""The `data` group's checks: what every source shares, then the source's own; and the keys
left null that the source's files say, filled into the job's config (`complete`).

Each `data=` option names its module in its YAML (`module`: runner/data/<option>.py), which
holds its check and its build; this asks it to check its keys and files, telling it what it
needs of the rest of the job (`request`). TensorFlow-free: a source module's check side
imports no TensorFlow (runner/data/__init__.py).
"""

from omegaconf import DictConfig, OmegaConf

from runner.config.model import KERAS_APP, is_target, pixel_range, takes_images
from runner.config.schema import IMAGE_MODELS
from runner.config.store import CONF_DIR, group_options
from runner.core.errors import ConfigError
from runner.data.checks import require
from runner.data.contract import Request, source_module

WORDS = {"image": "image", "tokens": "token"}  # a kind, as in "token data"


def request(cfg: DictConfig, images: bool) -> Request:
    """What the job tells its data source; `images`: the model takes images (else tokens)."""
    accum = 1 if cfg.accum == "auto" else cfg.accum
    pixels = pixel_range(cfg) if images else None
    return Request(images, pixels, cfg.trainer.seed, cfg.data.batch_size * accum)


def _min(d: DictConfig, key: str, low: int) -> None:
    value = d[key]  # null: the source's files say it (complete)
    require(value is None or value >= low, f"data.{key}", value, f"a number >= {low}")


def _smallest_image(cfg: DictConfig) -> int:
    """keras.applications refuse inputs smaller than 32x32; a model of one's own may not."""
    shipped = cfg.model.get("name") in IMAGE_MODELS or cfg.model.get("_target_") == KERAS_APP
    return 32 if shipped else 1


def complete(cfg: DictConfig, images: bool) -> None:
    """The keys cfg.data leaves null that its source's files say (a source module's
    `from_files`: an .npz's token length, its images' size), set in place, so that the job
    and the params it logs carry them. An image size is raised to the model's smallest."""
    d = cfg.data
    found = getattr(source_module(d.module), "from_files", None)
    if found is None:
        return
    for key, value in found(d, request(cfg, images)).items():
        d[key] = max(value, _smallest_image(cfg)) if key == "image_size" else value


def _giving(kind: str) -> list[str]:
    """The data options of conf/ whose source can feed `kind`."""
    found = []
    for option in group_options("data"):
        module = OmegaConf.load(CONF_DIR / "data" / f"{option}.yaml").get("module")
        if kind in source_module(module).KINDS:
            found.append(option)
    return found


def _check_kind(cfg: DictConfig, kinds: tuple[str, ...]) -> None:
    """The source can feed what the model takes."""
    kind = "image" if takes_images(cfg) else "tokens"
    if kind in kinds:
        return
    name = cfg.data.name
    if is_target(cfg.model):
        raise ConfigError("model.input_kind", kind, f"{' or '.join(kinds)} for data={name}")
    allowed = f"{WORDS[kind]} data for model={cfg.model.name} ({', '.join(_giving(kind))})"
    raise ConfigError("data", name, allowed)


def validate_data(cfg: DictConfig) -> None:
    """ConfigError for the first bad value of cfg.data, its source's check included; then
    the keys left null that the source's files say are filled in (complete)."""
    d = cfg.data
    _min(d, "batch_size", 1)
    _min(d, "shuffle_buffer", 1)
    images = takes_images(cfg)
    if images:
        _min(d, "image_size", _smallest_image(cfg))
    else:
        _min(d, "seq_len", 2)
    module = source_module(d.module)
    module.check(d, request(cfg, images))
    _check_kind(cfg, module.KINDS)
    complete(cfg, images)
