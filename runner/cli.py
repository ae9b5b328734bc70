"""Check the command line before Hydra and TensorFlow start, and say what is wrong in one line.

Hydra reports a bad override over several lines (and a bad range only once training has
begun); users asked for `precision=mixd` or `accum=0` to be answered with one line naming
the key, the bad value and what is allowed. So run.py composes the config here first,
once per value of each swept key, with Hydra's own compose API and the real conf/.
"""

import itertools
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from runner.config import ConfigError, register_configs, validate

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# Flags that print something instead of running a job: Hydra handles them itself.
_PASSTHROUGH = ("--help", "-h", "--hydra-help", "--shell-completion", "-sc", "--info", "-i")


def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _explain(override: str, others: list[str], err: Exception) -> str:
    """Turn a Hydra/OmegaConf compose error into `key=value: problem; expected ...`."""
    key, _, value = override.partition("=")
    if isinstance(err, ConfigCompositionException) and (CONF_DIR / key).is_dir():
        return f"{key}={value}: no such option; expected one of {', '.join(_group_options(key))}"
    cause = err.__cause__ if err.__cause__ is not None else err
    if isinstance(cause, ConfigKeyError | ConfigAttributeError):
        return (
            f"{key}={value}: unknown key; expected one of {', '.join(_sibling_keys(key, others))}"
        )
    if isinstance(cause, OmegaConfBaseException):
        msg = str(cause).splitlines()[0]
        return f"{key}={value}: {msg}"
    return f"{override}: {str(err).splitlines()[0]}"


def _sibling_keys(key: str, others: list[str]) -> list[str]:
    """Keys that exist beside a mistyped one, in the config the other overrides make."""
    node = compose(config_name="config", overrides=others)
    for part in key.lstrip("+~").split(".")[:-1]:
        node = node.get(part, {})
    return sorted(node.keys()) if hasattr(node, "keys") else []


def _compose_checked(overrides: list[str]) -> None:
    try:
        cfg = compose(config_name="config", overrides=overrides)
    except (ConfigCompositionException, OmegaConfBaseException) as err:
        i = _find_culprit(overrides)
        others = overrides[:i] + overrides[i + 1 :]
        raise SystemExit(f"error: {_explain(overrides[i], others, err)}") from None
    try:
        validate(cfg)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None


def _find_culprit(overrides: list[str]) -> int:
    """Index of the override that breaks composition (compose errors do not always name it)."""
    for i in range(len(overrides)):
        try:
            compose(config_name="config", overrides=overrides[: i + 1])
        except (ConfigCompositionException, OmegaConfBaseException):
            return i
    return len(overrides) - 1


def job_overrides(args: list[str]) -> list[list[str]]:
    """Expand sweeps into the override lists of the jobs they describe (one value per key)."""
    parsed = OverridesParser.create().parse_overrides(
        [a for a in args if not a.startswith("-") and not a.startswith("hydra")]
    )
    choices = []
    for ov in parsed:
        if ov.is_sweep_override():
            key = ov.get_key_element()
            choices.append([f"{key}={v}" for v in ov.sweep_string_iterator()])
        else:
            choices.append([ov.input_line])
    return [list(combo) for combo in itertools.product(*choices)]


def check_command_line(args: list[str]) -> None:
    """Exit with a one-line error if any job of this command line has a bad config."""
    if any(a in _PASSTHROUGH or a.startswith("--shell-completion") for a in args):
        return
    multirun = "-m" in args or "--multirun" in args
    try:
        jobs = job_overrides(args)
    except OverrideParseException as err:
        raise SystemExit(f"error: {str(err).splitlines()[0]}") from None
    if len(jobs) > 1 and not multirun:
        raise SystemExit("error: a key has several values; add -m to sweep over them")
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for overrides in jobs:
            _compose_checked(overrides)


if __name__ == "__main__":
    check_command_line(sys.argv[1:])
