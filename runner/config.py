"""Config schemas (one dataclass per option kind) and the checks Hydra's types cannot express.

Every YAML option in conf/ extends one of these schemas through its defaults list, so a
typo'd key or a wrong type fails at compose time. `validate` then checks ranges and choices
and raises `ConfigError`, whose one-line message names the key, the bad value and what is
allowed. Nothing here imports TensorFlow: bad input is rejected before the slow import.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from models.spec import EFFICIENTNET_VARIANTS, MOBILENET_VERSIONS

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("constant", "cosine")
CHECKPOINTING_POLICIES = ("none", "blocks", "sqrt", "every", "selective")
STRATEGIES = ("none", "mirrored", "multi_worker")  # distribution.strategy
PRECISION_NAMES = ("fp32", "mixed", "bf16")  # conf/precision/*.yaml
PRUNING_SCHEDULES = ("none", "constant", "polynomial", "m_by_n")
JIT_CHOICES = ("auto", "true", "false")
IMAGE_MODELS = ("mobilenet", "efficientnet")


class ConfigError(ValueError):
    """A bad config value: `str(err)` is the one line shown to the user."""

    def __init__(self, key: str, value: Any, allowed: str):
        super().__init__(f"{key}={value}: not allowed; expected {allowed}")
        self.key, self.value, self.allowed = key, value, allowed


@dataclass
class TransformerConfig:
    name: str = "transformer"
    h: int = 128
    layers: int = 2
    heads: int = 4
    dropout: float = 0.0
    weights: str | None = None


@dataclass
class MobileNetConfig:
    name: str = "mobilenet"
    version: str = "v2"
    alpha: float = 1.0
    weights: str | None = None


@dataclass
class EfficientNetConfig:
    name: str = "efficientnet"
    variant: str = "B0"
    weights: str | None = None


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    policy: str = "float32"
    # Dynamic loss scaling (float16 only): Keras LossScaleOptimizer's defaults.
    loss_scaling: bool = False
    initial_scale: float = 32768.0
    dynamic_growth_steps: int = 2000


@dataclass
class CheckpointingConfig:
    policy: str = "none"  # none | blocks | sqrt | every
    every: int = 2  # policy=every: blocks per recomputed segment


@dataclass
class PruningConfig:
    """Steps are optimizer steps counted from 1 (tfmot's pruning step);
    runner/techniques/pruning.py has the details."""

    schedule: str = "none"  # none | constant | polynomial | m_by_n
    target_sparsity: float = 0.5  # constant, polynomial: fraction of each kernel set to zero
    initial_sparsity: float = 0.0  # polynomial: the sparsity at begin_step
    power: float = 3.0  # polynomial: the exponent of the decay (tfmot's default)
    begin_step: int = 0  # masks are chosen at begin_step + k x frequency (step 0 never runs)
    end_step: int | None = None  # and at end_step, the last choice; null: the run's last step
    frequency: int = 100  # steps between mask choices (tfmot's default)
    regrow: bool = True  # pruned weights keep training and may be chosen back, as in tfmot
    m: int = 2  # m_by_n: keep the m largest of every n consecutive weights along the input axis
    n: int = 4
    include: list[str] = field(default_factory=list)  # regexes on variable paths; []: default
    exclude: list[str] = field(default_factory=list)  # regexes on variable paths to leave dense


@dataclass
class DistributionConfig:
    """How many replicas train the job (runner/techniques/distribution.py, issue 18)."""

    strategy: str = "none"  # none | mirrored | multi_worker
    devices: list[str] | None = None  # mirrored: the devices; null: every GPU, else every CPU
    logical_cpus: int = 0  # >= 2: split the CPU into that many logical devices (no GPU needed)


@dataclass
class DataConfig:
    name: str = MISSING
    batch_size: int = 32  # the micro-batch fed per step; accum multiplies it
    image_size: int = 32  # CNNs: images are resized to image_size x image_size x 3
    seq_len: int = 64  # transformer: tokens per example
    shuffle_buffer: int = 1024


@dataclass
class SyntheticDataConfig(DataConfig):
    name: str = "synthetic"
    num_classes: int = 10  # image classes
    vocab_size: int = 128  # token vocabulary
    train_samples: int = 2048
    val_samples: int = 256


@dataclass
class DigitsDataConfig(DataConfig):
    name: str = "digits"
    val_fraction: float = 0.2


@dataclass
class ImageFolderDataConfig(DataConfig):
    name: str = "image_folder"
    path: str = MISSING
    val_fraction: float = 0.2


@dataclass
class TrainerConfig:
    optimizer: str = "adam"
    lr: float = 1e-3
    schedule: str = "constant"  # constant | cosine (over the run's optimizer steps)
    warmup_steps: int = 0  # cosine only: linear warm-up from 0 to lr
    weight_decay: float = 0.0  # adamw only
    momentum: float = 0.9  # sgd only
    max_steps: int | None = None  # optimizer steps; None: epochs x steps per epoch
    epochs: int = 1
    eval_every: int = 0  # optimizer steps between evaluations; 0: only at the end
    eval_batches: int | None = None  # cap on validation batches; None: the whole split
    jit_compile: str = "auto"  # auto: XLA on GPUs, and on CPUs for the transformer
    seed: int = 0
    device: str = "auto"  # auto | cpu | gpu | /GPU:n | /CPU:n
    progress: bool = True
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: only on SIGTERM/SIGINT
    resume: str | None = None  # a run directory, or latest (the newest of the same job)
    deterministic: bool = False  # TensorFlow's op determinism: a resumed run ends bitwise equal
    # The effective batch (micro-batch x accum) accum=auto and runner.plan reach; null:
    # data.batch_size x accum as given.
    effective_batch_size: int | None = None


@dataclass
class MlflowConfig:
    tracking_uri: str = "sqlite:///outputs/mlflow.db"
    experiment: str = "tfmemlab"
    run_name: str | None = None  # None: the Hydra overrides, e.g. "precision=mixed accum=4"
    system_metrics: bool = False  # MLflow's own CPU/GPU/RAM sampling, as system/* metrics
    system_metrics_interval_s: float = 2.0


@dataclass
class SweepConfig:
    # The job the sweep's comparison divides by: a run name or job number; None: the first.
    baseline: str | None = None
    # Each job in a fresh process (memory figures of one job must not depend on the jobs
    # before it); false: jobs run in the sweep's process, faster to start.
    isolate: bool = True
    # A sweep directory (or `latest`) to launch again: finished jobs are skipped, stopped ones
    # go on from their checkpoints, failed ones run again (runner/sweep_resume.py).
    resume: str | None = None


@dataclass
class PlanConfig:
    # Memory budget for accum=auto and runner.plan: bytes or a unit string (8GiB, 512MiB); null:
    # the GPU's total memory, or on a CPU TF_CPU_BFC_MEM_LIMIT_IN_MB (runner/plan.py).
    budget: str | None = None
    margin: float = 0.1  # the share of the budget kept free for what the prediction misses
    measure: bool = False  # runner.plan: confirm each row that fits with a short probe
    precisions: list[str] = field(default_factory=lambda: ["fp32", "mixed", "bf16"])
    policies: list[str] = field(default_factory=lambda: ["none", "selective", "blocks", "sqrt"])


@dataclass
class ProfileConfig:
    # Profile the job layer by layer after its timed steps (runner/measure/profile.py, issue 14).
    layers: bool = False
    steps: int = 3  # steps of the job's train step timed without XLA, after one warm-up
    repeats: int = 3  # timed forward+backward calls per layer (the median is kept)


@dataclass
class Config:
    model: Any = MISSING
    precision: PrecisionConfig = MISSING
    checkpointing: CheckpointingConfig = MISSING
    pruning: PruningConfig = MISSING
    distribution: DistributionConfig = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = MISSING
    accum: Any = 1  # an integer >= 1, or auto (runner/plan.py)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def group_options(group: str) -> list[str]:
    """The options of a config group: its YAML files (the base_* schemas are not options)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _groups_help() -> str:
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
    return "\n".join(f"{g}: {', '.join(group_options(g))}" for g in groups)


def register_configs() -> None:
    """Store the schemas under the names the YAML defaults lists extend (base_<option>).

    Also registers the `tfmemlab_groups` resolver used by --help: Hydra's own group list
    would show the base_* schemas as if they were options.
    """
    OmegaConf.register_new_resolver("tfmemlab_groups", _groups_help, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, name, node in [
        ("model", "base_transformer", TransformerConfig),
        ("model", "base_mobilenet", MobileNetConfig),
        ("model", "base_efficientnet", EfficientNetConfig),
        ("precision", "base_precision", PrecisionConfig),
        ("checkpointing", "base_checkpointing", CheckpointingConfig),
        ("pruning", "base_pruning", PruningConfig),
        ("distribution", "base_distribution", DistributionConfig),
        ("data", "base_synthetic", SyntheticDataConfig),
        ("data", "base_digits", DigitsDataConfig),
        ("data", "base_image_folder", ImageFolderDataConfig),
        ("trainer", "base_trainer", TrainerConfig),
    ]:
        cs.store(group=group, name=name, node=node)


def compose_config(overrides: list[str]) -> DictConfig:
    """The real conf/ composed with these overrides, outside a Hydra app (tests, benchmarks)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


def _check_choice(cfg: DictConfig, key: str, choices: tuple) -> None:
    value = _get(cfg, key)
    _require(value in choices, key, value, "one of " + ", ".join(choices))


def _check_min(cfg: DictConfig, key: str, low: float, optional: bool = False) -> None:
    value = _get(cfg, key)
    if optional and value is None:
        return
    _require(value is not None and value >= low, key, value, f"a number >= {low}")


def _get(cfg: DictConfig, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _validate_model(cfg: DictConfig) -> None:
    name = cfg.model.name
    if name == "transformer":
        for key in ("model.h", "model.layers", "model.heads"):
            _check_min(cfg, key, 1)
        _require(
            cfg.model.h % cfg.model.heads == 0,
            "model.h",
            cfg.model.h,
            f"a multiple of model.heads={cfg.model.heads}",
        )
        _require(
            0.0 <= cfg.model.dropout < 1.0, "model.dropout", cfg.model.dropout, "a number in [0, 1)"
        )
        _require(
            cfg.data.name != "image_folder",
            "data",
            cfg.data.name,
            "token data for model=transformer (synthetic or digits)",
        )
    elif name == "mobilenet":
        _check_choice(cfg, "model.version", MOBILENET_VERSIONS)
        _require(cfg.model.alpha > 0, "model.alpha", cfg.model.alpha, "a number > 0")
    elif name == "efficientnet":
        _check_choice(cfg, "model.variant", EFFICIENTNET_VARIANTS)
    weights = cfg.model.weights
    _require(
        weights is None or Path(weights).is_file(),
        "model.weights",
        weights,
        "null or the path of an existing weights file",
    )


def _validate_data(cfg: DictConfig) -> None:
    _check_min(cfg, "data.batch_size", 1)
    _check_min(cfg, "data.shuffle_buffer", 1)
    if cfg.model.name in IMAGE_MODELS:
        # keras.applications refuse inputs smaller than 32x32.
        _check_min(cfg, "data.image_size", 32)
    else:
        _check_min(cfg, "data.seq_len", 2)
    if cfg.data.name == "synthetic":
        for key in ("data.num_classes", "data.vocab_size"):
            _check_min(cfg, key, 2)
        per_step = cfg.data.batch_size * (1 if cfg.accum == "auto" else cfg.accum)
        _require(
            cfg.data.train_samples >= per_step,
            "data.train_samples",
            cfg.data.train_samples,
            f"at least one optimizer step of data (data.batch_size x accum = {per_step})",
        )
        _check_min(cfg, "data.val_samples", 1)
    else:
        if cfg.data.name == "digits" and cfg.model.name == "transformer":
            _require(
                cfg.data.seq_len == 64,
                "data.seq_len",
                cfg.data.seq_len,
                "64 for data=digits (its 8x8 pixels are the tokens)",
            )
        _require(
            0.0 < cfg.data.val_fraction < 1.0,
            "data.val_fraction",
            cfg.data.val_fraction,
            "a number in (0, 1)",
        )
    if cfg.data.name == "image_folder":
        _require(
            Path(cfg.data.path).is_dir(),
            "data.path",
            cfg.data.path,
            "an existing directory with one sub-folder of images per class",
        )


def _validate_trainer(cfg: DictConfig) -> None:
    _check_choice(cfg, "trainer.optimizer", OPTIMIZERS)
    _require(cfg.trainer.lr > 0, "trainer.lr", cfg.trainer.lr, "a number > 0")
    _check_choice(cfg, "trainer.schedule", SCHEDULES)
    _check_min(cfg, "trainer.warmup_steps", 0)
    _check_min(cfg, "trainer.max_steps", 1, optional=True)
    _check_min(cfg, "trainer.epochs", 1)
    _check_min(cfg, "trainer.eval_every", 0)
    _check_min(cfg, "trainer.eval_batches", 1, optional=True)
    # `trainer.jit_compile=true` arrives as the string "True" in this str field.
    jit = str(cfg.trainer.jit_compile)
    _require(jit.lower() in JIT_CHOICES, "trainer.jit_compile", jit, "auto, true or false")
    device = cfg.trainer.device
    _require(
        bool(re.fullmatch(r"auto|cpu|gpu|/(CPU|GPU):\d+", device)),
        "trainer.device",
        device,
        "auto, cpu, gpu or a device name like /GPU:1",
    )
    _check_min(cfg, "trainer.checkpoint_every", 0)


def check_pruning_steps(pruning, total_steps: int) -> None:
    """begin_step and end_step must fall within the run's optimizer steps (1 to total_steps),
    so the masks reach their target while it still trains, and the last choice (end_step,
    null: the last step) must follow a trained step. Also called once total_steps is known."""
    for key in ("begin_step", "end_step"):
        value = pruning[key]
        allowed = f"a step <= {total_steps} (the run has {total_steps} optimizer steps)"
        _require(value is None or value <= total_steps, f"pruning.{key}", value, allowed)
    allowed = "a step >= 2, or null in a run of >= 2 optimizer steps"
    _require(pruning.end_step is not None or total_steps >= 2, "pruning.end_step", None, allowed)


def _validate_pruning(cfg: DictConfig) -> None:
    p = cfg.pruning
    _check_choice(cfg, "pruning.schedule", PRUNING_SCHEDULES)
    for key in ("target_sparsity", "initial_sparsity"):
        _require(0.0 <= p[key] < 1.0, f"pruning.{key}", p[key], "a number in [0, 1)")
    _require(p.power > 0, "pruning.power", p.power, "a number > 0")
    _check_min(cfg, "pruning.begin_step", 0)
    _check_min(cfg, "pruning.frequency", 1)
    # Step 1 starts from the initial weights: masks chosen there would prune at random (issue
    # 13). The first choice is at begin_step, or at frequency when begin_step is 0.
    untrained = "(step 1 starts from the untrained weights)"
    _require(p.begin_step != 1, "pruning.begin_step", p.begin_step, f"0 or >= 2 {untrained}")
    first_ok = p.begin_step > 0 or p.frequency > 1
    _require(first_ok, "pruning.frequency", p.frequency, f">= 2 with begin_step=0 {untrained}")
    _check_min(cfg, "pruning.m", 1)
    _require(p.n > p.m, "pruning.n", p.n, f"a group size > pruning.m={p.m}")
    end = p.end_step
    end_ok = end is None or end >= max(p.begin_step, 2)
    _require(end_ok, "pruning.end_step", end, f"null or >= begin_step and >= 2 {untrained}")
    for key in ("include", "exclude"):
        for pattern in p[key]:
            try:
                re.compile(pattern)
            except re.error:
                raise ConfigError(f"pruning.{key}", pattern, "regular expressions") from None
    if p.schedule != "none" and cfg.trainer.max_steps is not None:
        check_pruning_steps(p, cfg.trainer.max_steps)


def _validate_accum_and_plan(cfg: DictConfig) -> None:
    from runner.plan import BYTES_ALLOWED, PlanError, parse_bytes

    accum = cfg.accum
    ok = accum == "auto" or (isinstance(accum, int) and not isinstance(accum, bool) and accum >= 1)
    _require(ok, "accum", accum, "an integer >= 1, or auto")
    _check_min(cfg, "trainer.effective_batch_size", 1, optional=True)
    for key, allowed in (("precisions", PRECISION_NAMES), ("policies", CHECKPOINTING_POLICIES)):
        for value in cfg.plan[key]:
            _require(value in allowed, f"plan.{key}", value, f"a list of {', '.join(allowed)}")
    margin = cfg.plan.margin
    _require(0 <= margin < 1, "plan.margin", margin, "a number in [0, 1)")
    if cfg.plan.budget is not None:
        try:
            parse_bytes(cfg.plan.budget)
        except PlanError:
            raise ConfigError("plan.budget", cfg.plan.budget, BYTES_ALLOWED) from None


def _validate_distribution(cfg: DictConfig) -> None:
    d = cfg.distribution
    _check_choice(cfg, "distribution.strategy", STRATEGIES)
    if d.logical_cpus != 0:
        ok = d.logical_cpus >= 2 and d.strategy == "mirrored"
        _require(
            ok,
            "distribution.logical_cpus",
            d.logical_cpus,
            "0, or an integer >= 2 with distribution=mirrored",
        )
    if d.devices is not None:
        ok = d.strategy == "mirrored" and len(d.devices) >= 1
        ok = ok and all(re.fullmatch(r"/?(CPU|GPU):\d+", str(x)) for x in d.devices)
        _require(
            ok,
            "distribution.devices",
            list(d.devices),
            "null, or a list like [/GPU:0,/GPU:1] with distribution=mirrored",
        )
    if d.strategy != "none":  # both measure one device's job in one process
        _require(
            cfg.accum != "auto",
            "accum",
            cfg.accum,
            "an integer >= 1 with distribution.strategy=" + d.strategy,
        )
        _require(
            not cfg.profile.layers,
            "profile.layers",
            cfg.profile.layers,
            "false with distribution.strategy=" + d.strategy,
        )


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError for the first bad value; cheap, no TensorFlow."""
    _validate_accum_and_plan(cfg)
    _check_choice(cfg, "precision.policy", POLICIES)
    _check_choice(cfg, "checkpointing.policy", CHECKPOINTING_POLICIES)
    _check_min(cfg, "checkpointing.every", 1)
    _validate_pruning(cfg)
    _validate_distribution(cfg)
    _validate_model(cfg)
    _validate_data(cfg)
    _validate_trainer(cfg)
    _check_min(cfg, "profile.steps", 1)
    _check_min(cfg, "profile.repeats", 1)
