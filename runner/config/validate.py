"""The checks Hydra's types cannot express: ranges, choices and keys that depend on each other.

`validate(cfg)` raises ConfigError for the first bad value, whose one-line message names the
key, the bad value and what is allowed; then it sets the data keys left null that the data's
files say (runner/config/data.py). Free of TensorFlow, and cheap but for a user's data files:
their headers, and the labels of TFRecord images without data.num_classes (under 1 GiB).
"""

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from models.spec import ATTENTION_KINDS, EFFICIENTNET_VARIANTS, MOBILENET_VERSIONS
from runner.config.data import validate_data
from runner.config.deploy_checks import check_deploy
from runner.config.model import (
    INPUT_KINDS,
    KERAS_APP,
    check_keras_app,
    check_target,
    is_target,
)
from runner.config.schema import (
    CHECKPOINTING_POLICIES,
    JIT_CHOICES,
    OPTIMIZERS,
    POLICIES,
    PRECISION_NAMES,
    SCHEDULES,
    STRATEGIES,
)
from runner.core.errors import ConfigError, PlanError
from runner.core.units import BYTES_ALLOWED, parse_bytes
from runner.schedules import schedule_of


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


def _check_choice(cfg: DictConfig, key: str, choices: tuple) -> None:
    value = _get(cfg, key)
    _require(value in choices, key, value, "one of " + ", ".join(choices))


def _check_min(cfg: DictConfig, key: str, low: float, optional: bool = False) -> None:
    value = _get(cfg, key)
    if not (optional and value is None):
        _require(value is not None and value >= low, key, value, f"a number >= {low}")


def _get(cfg: DictConfig, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _validate_target(m: DictConfig) -> None:
    """A `_target_` model (runner/config/model.py): its builder found, its reserved keys sound."""
    check_target(m._target_)
    if m._target_ == KERAS_APP:
        check_keras_app(m.get("name"))
    kind = m.get("input_kind", "image")
    _require(kind in INPUT_KINDS, "model.input_kind", kind, "image or tokens")
    given = m.get("input_range")
    ok = given is None or (
        len(given) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in given)
        and given[0] < given[1]
    )
    _require(ok, "model.input_range", given, "null or [low, high] with low < high")


def _validate_model(cfg: DictConfig) -> None:
    name = cfg.model.get("name")
    if is_target(cfg.model):
        _validate_target(cfg.model)
    elif name == "transformer":
        for key in ("model.h", "model.layers", "model.heads"):
            _check_min(cfg, key, 1)
        h, heads = cfg.model.h, cfg.model.heads
        _require(h % heads == 0, "model.h", h, f"a multiple of model.heads={heads}")
        drop = cfg.model.dropout
        _require(0.0 <= drop < 1.0, "model.dropout", drop, "a number in [0, 1)")
        _check_choice(cfg, "model.attention", ATTENTION_KINDS)
        _check_min(cfg, "model.attention_block", 1)  # an int: the schema says so
    elif name == "mobilenet":
        _check_choice(cfg, "model.version", MOBILENET_VERSIONS)
        _require(cfg.model.alpha > 0, "model.alpha", cfg.model.alpha, "a number > 0")
    elif name == "efficientnet":
        _check_choice(cfg, "model.variant", EFFICIENTNET_VARIANTS)
    weights = cfg.model.get("weights")
    _require(
        weights is None or Path(weights).is_file(),
        "model.weights",
        weights,
        "null or the path of an existing weights file",
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
    _check_min(cfg, "trainer.bn_recalibrate", 0)
    if cfg.trainer.bn_recalibrate:  # runs the model outside the strategy's replicas
        strategy = cfg.distribution.strategy
        allowed = "0 with distribution.strategy=" + strategy
        _require(strategy == "none", "trainer.bn_recalibrate", cfg.trainer.bn_recalibrate, allowed)


def _validate_pruning(cfg: DictConfig) -> None:
    """The schedule's own checks (runner/schedules/), with the run's steps where they are given."""
    schedule = schedule_of(cfg.pruning)
    schedule.check(cfg.trainer.max_steps)
    if schedule.removes:  # the rebuilt model's variables are made outside a strategy's replicas
        strategy = cfg.distribution.strategy
        allowed = "pruning=structured with distribution=none (the rebuild is not distributed)"
        _require(strategy == "none", "distribution.strategy", strategy, allowed)


def _validate_accum_and_plan(cfg: DictConfig) -> None:
    accum = cfg.accum
    ok = accum == "auto" or (isinstance(accum, int) and not isinstance(accum, bool) and accum >= 1)
    _require(ok, "accum", accum, "an integer >= 1, or auto")
    _check_min(cfg, "trainer.effective_batch_size", 1, optional=True)
    lists = (("precisions", PRECISION_NAMES), ("policies", CHECKPOINTING_POLICIES))
    for key, allowed in (*lists, ("attention", ATTENTION_KINDS)):
        for value in cfg.plan[key]:
            _require(value in allowed, f"plan.{key}", value, f"a list of {', '.join(allowed)}")
    _require(0 <= cfg.plan.margin < 1, "plan.margin", cfg.plan.margin, "a number in [0, 1)")
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
    """Raise ConfigError for the first bad value; then fill in what the data's files say."""
    _validate_accum_and_plan(cfg)
    _check_choice(cfg, "precision.policy", POLICIES)
    _check_choice(cfg, "checkpointing.policy", CHECKPOINTING_POLICIES)
    _check_min(cfg, "checkpointing.every", 1)
    _validate_pruning(cfg)
    _validate_distribution(cfg)
    _validate_model(cfg)
    validate_data(cfg)
    _validate_trainer(cfg)
    check_deploy(cfg.deploy, cfg.trainer.save_model)
    _check_min(cfg, "profile.steps", 1)
    _check_min(cfg, "profile.repeats", 1)
    _validate_sweep(cfg)


def _validate_sweep(cfg: DictConfig) -> None:
    s = cfg.sweep  # repeats: an int (the schema says so), each in a fresh process
    _require(s.repeats >= 1, "sweep.repeats", s.repeats, "an integer >= 1")
    _require(s.isolate or s.repeats == 1, "sweep.isolate", False, "true with sweep.repeats > 1")
    for key in s.varies:  # a misspelt group would leave its differences marked unlike
        known = OmegaConf.select(cfg, key, default=ConfigError) is not ConfigError
        _require(known, "sweep.varies", key, "a list of config groups or keys, e.g. [model]")
