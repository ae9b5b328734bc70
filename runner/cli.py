"""Check the command line before Hydra and TensorFlow start, and say what is wrong in one line.

Hydra reports a bad override over several lines (and a bad range only once training has
begun); users asked for `precision=mixd` or `accum=0` to be answered with one line naming
the key, the bad value and what is allowed. So run.py composes the config here first,
once per value of each swept key, with Hydra's own compose API and the real conf/.
"""

import itertools
import sys
from dataclasses import fields
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from runner.config import CONF_DIR, group_options, name_model, register_configs, validate
from runner.config.store import search_path
from runner.core.errors import BusyError, ConfigError, ModelError, ResumeError, TrackingError
from runner.schedules import SCHEDULES
from runner.track.rundir import locate
from runner.track.server import check_store

# A user's --config-dir, and the search-path override that adds it, set per command line.
_USER_DIRS: list[Path] = []
_EXTRA: list[str] = []


def _compose(overrides: list[str]) -> DictConfig:
    return compose(config_name="config", overrides=[*overrides, *_EXTRA])


def _check_yaml(config_dir: str) -> None:
    """Every YAML file in a user's config folder parses: a malformed one is named, with its
    line, before Hydra reports it over several lines."""
    root = Path(config_dir)
    if not root.is_dir():
        raise SystemExit(f"error: --config-dir {config_dir}: no such directory")
    for path in sorted(root.rglob("*.yaml")):
        try:
            yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            context = getattr(err, "context_mark", None)
            if context is not None and mark is not None and context.line != mark.line:
                problem += f"; {err.context} from line {context.line + 1}"
            raise SystemExit(f"error: {where}: malformed YAML ({problem})") from None


def _explain(override: str, others: list[str], err: Exception) -> str:
    """Turn a Hydra/OmegaConf compose error into `key=value: problem; expected ...`."""
    key, _, value = override.partition("=")
    if isinstance(err, ConfigCompositionException) and (CONF_DIR / key).is_dir():
        options = group_options(key) + [
            p.stem for d in _USER_DIRS for p in (d / key).glob("*.yaml")
        ]
        return f"{key}={value}: no such option; expected one of {', '.join(sorted(options))}"
    cause = err.__cause__ if err.__cause__ is not None else err
    if isinstance(cause, ConfigKeyError | ConfigAttributeError):
        siblings = ", ".join(_sibling_keys(key, others))
        return (
            f"{key}={value}: unknown key; expected one of {siblings}{_schedules_with(key, value)}"
        )
    if isinstance(cause, OmegaConfBaseException):
        msg = str(cause).splitlines()[0]
        return f"{key}={value}: {msg}"
    return f"{override}: {str(err).splitlines()[0]}"


def _schedules_with(key: str, value: str) -> str:
    """For a pruning key the chosen schedule lacks (each schedule has its own keys:
    runner/schedules/), which schedules have it, and how a sweep over schedules sets it."""
    group, _, leaf = key.lstrip("+~").partition(".")
    having = [name for name, cls in SCHEDULES.items() if leaf in {f.name for f in fields(cls)}]
    if group != "pruning" or not having:
        return ""
    return (
        f" (a key of pruning={','.join(sorted(having))}; in a sweep over schedules, "
        f"++{group}.{leaf}={value} sets it where a schedule has it)"
    )


def _sibling_keys(key: str, others: list[str]) -> list[str]:
    """Keys that exist beside a mistyped one, in the config the other overrides make."""
    node = _compose(others)
    for part in key.lstrip("+~").split(".")[:-1]:
        node = node.get(part, {})
    return sorted(node.keys()) if hasattr(node, "keys") else []


def _compose_checked(overrides: list[str]) -> DictConfig:
    try:
        cfg = name_model(_compose(overrides))
    except (ConfigCompositionException, OmegaConfBaseException) as err:
        i = _find_culprit(overrides)
        others = overrides[:i] + overrides[i + 1 :]
        raise SystemExit(f"error: {_explain(overrides[i], others, err)}") from None
    try:
        validate(cfg)
    except (ConfigError, ModelError) as err:
        raise SystemExit(f"error: {err}") from None
    return cfg


def _find_culprit(overrides: list[str]) -> int:
    """Index of the override that breaks composition (compose errors do not always name it):
    the first whose prefix fails to compose, with the groups' choices taken first. Hydra applies
    `data=arrays` before `data.train_samples=32` whatever their order, so a key the chosen
    option lacks is the key's fault, not the option's."""
    order = sorted(range(len(overrides)), key=lambda i: "." in overrides[i].split("=", 1)[0])
    for n, i in enumerate(order):
        try:
            _compose([overrides[j] for j in order[: n + 1]])
        except (ConfigCompositionException, OmegaConfBaseException):
            return i
    return len(overrides) - 1


def job_overrides(overrides: list[str]) -> list[list[str]]:
    """Expand sweeps into the override lists of the jobs they describe (one value per key)."""
    parsed = OverridesParser.create().parse_overrides(
        [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    )
    choices = []
    for ov in parsed:
        if ov.is_sweep_override():
            key = ov.get_key_element()
            choices.append([f"{key}={v}" for v in ov.sweep_string_iterator()])
        else:
            choices.append([ov.input_line])
    return [list(combo) for combo in itertools.product(*choices)]


def check_command_line(argv: list[str]) -> None:
    """Exit with a one-line error if any job of this command line has a bad config."""
    # Hydra's own argument parser separates its flags (--cfg job, -m, ...) from overrides.
    args = get_args_parser().parse_args(argv)
    if (
        args.help
        or args.hydra_help
        or args.shell_completion
        or args.info
        or args.config_name
        or args.config_path
    ):
        return  # Hydra answers these itself, or composes a config this check does not know
    _EXTRA[:] = search_path(args.config_dir)
    _USER_DIRS[:] = [Path(args.config_dir)] if args.config_dir else []
    if args.config_dir:  # a user's own config folder (its model YAML, say) beside conf/
        _check_yaml(args.config_dir)
    try:
        jobs = job_overrides(args.overrides)
    except OverrideParseException as err:
        raise SystemExit(f"error: {str(err).splitlines()[0]}") from None
    if len(jobs) > 1 and not args.multirun:
        raise SystemExit("error: a key has several values; add -m to sweep over them")
    register_configs()
    uris = set()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for overrides in jobs:
            cfg = _compose_checked(overrides)
            uris.add(cfg.mlflow.tracking_uri)
            if cfg.trainer.resume:
                try:
                    uris.add(locate(cfg.trainer.resume, overrides).tracking_uri)
                except (ResumeError, BusyError) as err:  # BusyError: another process has it
                    raise SystemExit(f"error: {err}") from None
    for uri in sorted(uris):  # a server that is down: one line now, not minutes of retries
        try:
            check_store(uri)
        except TrackingError as err:
            raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    check_command_line(sys.argv[1:])
