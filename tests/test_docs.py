"""The commands quoted in README.md and docs/*.md still work, so none rots silently.

Each command in a fenced code block is checked without running it: `python run.py ...` (and
`python -m runner.plan` / `runner.bench`, which take run.py's overrides) has every job of its
sweep composed with the real conf/, Hydra's own options included; any other
`python -m runner.<module>` has its arguments parsed by the module's own parser; `mlflow ...`
by MLflow's command line; `python -m pytest ...` must name files and markers that exist. A
quoted session (`$ python run.py ...` followed by `error: ...`) must print that line. The
pages must also name every config key, link to headings that exist and quote paths that
exist. No TensorFlow is imported and nothing trains: the whole file takes seconds.

Jobs are composed as runner.config.compose_config composes them (the schemas registered,
conf/ as the search path), with `return_hydra_config=True`, so that overrides of Hydra itself
(`hydra/launcher=joblib`, `hydra.launcher.n_jobs=2`) are composed too and a preset's own sweep
(`hydra.sweeper.params`) can be expanded. `validate` is not called: a quoted path such as
`data.path=$HOME/photos` need not exist here, but a key or option that does not exist fails.
A command is split as the shell splits it (shlex, then `$VAR` and a leading `~` expanded):
Hydra refuses a `~` the shell left in place, as in `data.path=~/photos`.
"""

import importlib
import importlib.util
import os
import re
import shlex
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runner.cli import check_command_line, job_overrides
from runner.config import CONF_DIR, register_configs
from runner.config.store import search_path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
# What runs a quoted command on a cluster, before the command itself.
LAUNCHERS = ("srun ",)


@dataclass(frozen=True)
class Quote:
    """A command quoted in a page: where, and its text (continuation lines joined, the
    trailing `# comment` stripped); for a quoted session, the line printed after it."""

    page: Path
    line: int
    text: str
    printed: str | None = None
    part: int = 0  # the second of two commands joined by && on one line: 1

    @property
    def where(self) -> str:
        where = f"{self.page.relative_to(REPO)}:{self.line}"
        return f"{where}-part{self.part + 1}" if self.part else where


def fenced_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line inside a fenced code block of the page, with
    continuation lines (ending in a backslash) joined onto the first."""
    out, inside, pending = [], False, None
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            continue
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.strip())
        else:
            pending = (number, line.strip())
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1].rstrip())
            continue
        out.append(pending)
        pending = None
    return out


def shell_words(text: str) -> list[str]:
    """The words the shell would pass: split, `$VAR` expanded, and `~` at a word's start (only
    there: bash leaves `data.path=~/photos` as it is)."""
    return [os.path.expanduser(os.path.expandvars(word)) for word in shlex.split(text)]


def strip_comment(text: str) -> str:
    """The command without its trailing `# comment` (as .ci/run strips it)."""
    return re.sub(r"\s+#.*$", "", text).strip()


def commands(page: Path) -> list[Quote]:
    """Every command of the page's code blocks, one per `&&`-joined part of a line."""
    found = []
    for number, text in fenced_lines(page):
        parts = []
        for part in re.split(r"\s+&&\s+", strip_comment(text)):
            part = part.removesuffix("&").strip()  # a server started in the background
            part = re.sub(r"^(\w+=\S+\s+)+", "", part)  # PYTHONPATH=examples python run.py
            for launcher in LAUNCHERS:
                part = part.removeprefix(launcher)
            if part.startswith(("python run.py", "python -m ", "mlflow ")):
                parts.append(part)
        found += [Quote(page, number, part, part=i) for i, part in enumerate(parts)]
    return found


def sessions(page: Path) -> list[Quote]:
    """Quoted sessions: `$ python run.py ...` followed by the line it prints."""
    lines = fenced_lines(page)
    return [
        Quote(page, number, text.removeprefix("$ "), lines[i + 1][1])
        for i, (number, text) in enumerate(lines[:-1])
        if text.startswith("$ python run.py ")
    ]


ALL_COMMANDS = [q for page in PAGES for q in commands(page)]
ALL_SESSIONS = [q for page in PAGES for q in sessions(page)]


# --- composing run.py's command lines ---------------------------------------------------


@cache
def compose_job(overrides: tuple[str, ...], config_dir: str | None = None) -> DictConfig:
    """One job's config with Hydra's own node, composed with the real conf/ (and a user's
    config folder, as `--config-dir`, relative to the repository, adds it)."""
    register_configs()
    extra = search_path(REPO / config_dir) if config_dir else []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            config_name="config", overrides=[*overrides, *extra], return_hydra_config=True
        )


def with_preset_sweep(overrides: list[str], cfg: DictConfig) -> list[str]:
    """The overrides with a preset's own sweep (hydra.sweeper.params, as in
    conf/experiment/memory_study.yaml) before them; as Hydra's basic sweeper does, a key
    given on the command line replaces the preset's."""
    params = cfg.hydra.sweeper.get("params") or {}
    given = {
        ov.key_or_group
        for ov in OverridesParser.create().parse_overrides(
            [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
        )
    }
    preset = [f"{key}={value}" for key, value in params.items() if key not in given]
    return preset + overrides


def check_overrides(argv: list[str]) -> list[list[str]]:
    """Compose every job of a run.py command line; return the jobs' overrides."""
    try:
        args = get_args_parser().parse_args(argv)  # Hydra's flags apart from the overrides
    except SystemExit:
        pytest.fail(f"Hydra's command line refuses {argv}")
    if args.config_path or args.config_name:
        pytest.skip("composes a config folder of its own (--config-path, --config-name)")
    if args.config_dir:
        assert (REPO / args.config_dir).is_dir(), f"--config-dir {args.config_dir}: no folder"
    own = [o for o in args.overrides if o.lstrip("+~").startswith("hydra")]
    jobs = job_overrides(args.overrides)
    assert len(jobs) == 1 or args.multirun, "a key has several values: the command needs -m"
    first = compose_job(tuple(jobs[0] + own), args.config_dir)
    if args.multirun or first.hydra.mode == RunMode.MULTIRUN:  # -m, or a preset that sweeps
        jobs = job_overrides(with_preset_sweep(args.overrides, first))
    for job in jobs:
        compose_job(tuple(job + own), args.config_dir)
    return jobs


# --- parsing a module's own command line ------------------------------------------------


def check_module(name: str, argv: list[str]) -> None:
    """`python -m NAME ARGV`: the module exists and takes these arguments."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        spec = None
    assert spec is not None, f"no module {name}"
    if name == "runner.plan":  # run.py's overrides
        check_overrides(argv)
        return
    if name == "runner.bench":  # a benchmark's name, then run.py's overrides
        benches = importlib.import_module("runner.bench.__main__").BENCHES
        assert argv and argv[0] in benches, f"no benchmark {argv[:1]}; expected one of {benches}"
        extra = argv[1:]
        if argv[0] == "checkpointing" and extra[:1] == ["--unseen"]:  # model names, no overrides
            models = importlib.import_module("runner.bench.cuts").MODELS
            assert set(extra[1:]) <= set(models), f"--unseen takes some of {list(models)}"
            return
        if argv[0] == "estimate" and extra[:1] == ["--unseen"]:  # then run.py's overrides
            extra = extra[1:]
        if argv[0] == "estimate" and extra[:1] == ["--draws"]:  # N [--seed S], then overrides
            _, _, extra = importlib.import_module("runner.bench.estimate").draw_args(extra)
        if argv[0] == "attention":  # its own options (--core: the core alone, no overrides)
            bench = importlib.import_module("runner.bench.attention")
            core = importlib.import_module("runner.bench.attention_core")
            if extra[:1] == ["--core"]:
                core.command_line().parse_args(extra[1:])
                return
            _, extra = bench.command_line().parse_known_args(extra)
        if argv[0] == "plan" and extra[:1] == ["--time"]:  # [--repeats N] [--steps S]
            extra = importlib.import_module("runner.bench.plan").time_args(extra[1:])[0]
        if argv[0] in ("checkpointing", "precision_accum", "overhead"):  # --repeats N
            extra = importlib.import_module("runner.bench.noise").take_repeats(extra)[1]
        if argv[0] == "checkpointing":  # --only NAME picks some of its groups
            _, extra = importlib.import_module("runner.bench.checkpointing")._only(extra)
        check_overrides(extra)
        return
    if spec.submodule_search_locations:  # a package: `python -m` runs its __main__
        name = f"{name}.__main__"
    module = importlib.import_module(name)
    assert hasattr(module, "command_line"), f"python -m {name}: no command_line() to check"
    try:  # the module's own parser, as its main() uses it; nothing runs
        overrides = getattr(module.command_line().parse_args(argv), "overrides", None)
    except SystemExit as exit_:
        pytest.fail(f"python -m {name} refuses {argv}: exit {exit_.code}")
    if name == "runner.launch" and overrides:  # the workers' run.py overrides
        check_overrides(["distribution=multi_worker", *overrides])
    if name == "runner.deploy.__main__":  # deploy.KEY=VALUE, as the command checks them
        importlib.import_module("runner.deploy.target").deploy_settings(None, overrides)


def check_mlflow(argv: list[str]) -> None:
    import click
    from mlflow.cli import cli

    context = click.Context(cli, info_name="mlflow")
    command = cli.get_command(context, argv[0]) if argv else None
    assert command is not None, f"mlflow has no command {argv[:1]}"
    try:
        command.make_context(argv[0], argv[1:], parent=context)  # parses; runs nothing
    except click.ClickException as err:
        pytest.fail(f"mlflow {argv[0]}: {err.format_message()}")


def check_pytest(argv: list[str]) -> None:
    """Files named exist; markers named are declared in pyproject.toml."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    markers = {m.split(":")[0] for m in config["tool"]["pytest"]["ini_options"]["markers"]}
    takes_value = {"-n", "--dist", "-m", "-k", "-p", "-c", "--maxfail", "--durations"}
    args = iter(argv)
    for arg in args:
        if arg == "-m":
            named = set(re.findall(r"[A-Za-z_]\w*", next(args))) - {"and", "or", "not"}
            assert named <= markers, f"markers not declared in pyproject.toml: {named - markers}"
        elif arg in takes_value:
            next(args)
        elif not arg.startswith("-"):
            assert (REPO / arg.split("::")[0]).exists(), f"no such test file: {arg}"


# --- the tests ------------------------------------------------------------------------------


def test_the_pages_quote_commands_of_every_kind():
    """The search itself finds what the pages quote (a broken search would check nothing)."""
    starts = {q.text.split()[1] if q.text.startswith("python") else "mlflow" for q in ALL_COMMANDS}
    assert {"run.py", "-m", "mlflow"} <= starts
    assert len(ALL_COMMANDS) > 40
    readme = [q for q in ALL_COMMANDS if q.page.name == "README.md"]
    assert readme[0].text == "python run.py"  # the first code block's: install, then run
    assert any(q.text.startswith("python -m pytest") for q in readme)


def test_a_preset_sweeps_its_variants_unless_the_command_line_picks_them():
    """conf/experiment/memory_study.yaml sweeps its own jobs (hydra.sweeper.params), as
    Hydra's basic sweeper runs them: every variant is composed, or those the command names."""
    jobs = check_overrides(["+experiment=memory_study"])
    assert [j[0] for j in jobs] == [f"variant={v}" for v in ("baseline", "mixed", "bf16",
        "accum4", "remat", "pruned")]  # fmt: skip
    picked = check_overrides(["-m", "+experiment=memory_study", "variant=baseline,accum4"])
    assert picked == [["+experiment=memory_study", f"variant={v}"] for v in ("baseline", "accum4")]


@pytest.mark.parametrize("quote", ALL_COMMANDS, ids=[q.where for q in ALL_COMMANDS])
def test_quoted_command_composes_or_parses(quote: Quote):
    argv = shell_words(quote.text)
    if argv[:2] == ["python", "run.py"]:
        check_overrides(argv[2:])
    elif argv[:3] == ["python", "-m", "pytest"]:
        check_pytest(argv[3:])
    elif argv[:2] == ["python", "-m"]:
        check_module(argv[2], argv[3:])
    elif argv[0] == "mlflow":
        check_mlflow(argv[1:])
    else:
        pytest.fail(f"no check for {quote.text}")


@pytest.mark.parametrize("quote", ALL_SESSIONS, ids=[q.where for q in ALL_SESSIONS])
def test_quoted_session_prints_what_the_page_says(quote: Quote):
    """The one-line errors quoted in the pages are the ones run.py prints (runner/cli.py)."""
    with pytest.raises(SystemExit) as exit_:
        check_command_line(shell_words(quote.text)[2:])
    assert exit_.value.code == quote.printed


def schema_keys() -> set[str]:
    """Every leaf key of the config schema: the base_* nodes Hydra's ConfigStore holds."""
    register_configs()
    repo = ConfigStore.instance().repo
    keys = set()

    def walk(node, prefix: str) -> None:
        for key in node:
            missing = OmegaConf.is_missing(node, key)
            if missing and not prefix:
                continue  # a config group (model, data, ...): its options' keys below
            value = None if missing else node[key]
            if isinstance(value, DictConfig):
                walk(value, f"{prefix}{key}.")
            else:
                keys.add(f"{prefix}{key}")

    walk(repo["base_config.yaml"].node, "")
    for group in (p.name for p in CONF_DIR.iterdir() if p.is_dir()):
        for name, entry in repo.get(group, {}).items():
            if name.startswith("base_"):
                walk(entry.node, f"{group}.")
    return keys


def test_usage_names_every_config_key():
    text = (REPO / "docs" / "usage.md").read_text()
    keys = schema_keys()
    assert {"accum", "model.h", "trainer.lr", "plan.budget"} <= keys
    assert sorted(k for k in keys if f"`{k}`" not in text) == []


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The page's anchors; a heading seen before gets -1, -2, ... as on GitHub."""
    found, inside = set(), False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside and (m := re.match(r"#{1,6} (.+)", line)):
            base = anchor = slug(m.group(1))
            n = 0
            while anchor in found:
                n += 1
                anchor = f"{base}-{n}"
            found.add(anchor)
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_links_between_pages_resolve(page: Path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and anchor not in anchors(linked)):
            broken.append(target)
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_quoted_paths_exist(page: Path):
    """A file or folder of the project quoted in backticks exists (no path from before a
    restructure); paths with a placeholder (`conf/<group>/`) are left alone."""
    path = r"`((?:runner|models|conf|tests|docs|\.ci)/[\w./-]*|run\.py)`"
    quoted = re.findall(path, page.read_text())
    assert sorted(p for p in set(quoted) if not (REPO / p).exists()) == []


def test_the_code_cites_only_what_a_reader_of_the_project_has():
    """A comment or docstring cites a file of the project (a page of docs/ that exists), a
    dependency's source file, an issue thread or a paper: never a document kept outside the
    repository, which a reader of tfmemlab does not have (issue 48: 18 comments cited one)."""
    outside = re.compile(r"shared " + "GUIDE|" + r"\.\./shared/")
    page = re.compile(r"docs/[\w./-]+\.md")
    cited, missing = [], []
    for top in ("runner", "models", "examples", "tests", "conf"):
        for path in sorted((REPO / top).rglob("*.py")) + sorted((REPO / top).rglob("*.yaml")):
            text = path.read_text()
            where = path.relative_to(REPO)
            cited += [f"{where}: {m}" for m in outside.findall(text)]
            missing += [f"{where}: {p}" for p in page.findall(text) if not (REPO / p).exists()]
    assert cited == [] and missing == []
