"""The house's rules, checked from the code itself (nothing is imported or run): no import
circles (function-local imports count: a lazy import hides a circle, it does not remove it),
no import from a lower layer up to a higher one, and no module over 300 lines. The layer
order is the one docs/architecture.md draws."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT = 300
# Bottom up. A module may import its own layer's modules and any lower layer's, never a
# higher one's. `models` sits beside `runner.core`: it imports no tfmemlab package.
LAYERS = [
    ("models", "runner.core"),
    ("runner.data", "runner.schedules"),
    ("runner.config",),
    ("runner.feed", "runner.channels"),
    ("runner.techniques",),
    ("runner.estimate",),
    ("runner.measure",),
    ("runner.track",),
    ("runner.report",),
    ("runner.deploy",),
    ("runner.train",),
    ("runner.cli",),
    ("runner.plan", "runner.sweep"),
    ("runner.launch", "runner.bench"),
    ("run",),
]


def modules() -> dict[str, Path]:
    """Every module of the project's packages (folders with __init__.py) and run.py."""
    found = {"run": REPO / "run.py"}
    for top in ("runner", "models"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            name = ".".join(rel.parts).removesuffix(".__init__")
            found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            # A package's __init__ may name its own modules (re-exports, lazy attributes).
            if target and target != name and not target.startswith(name + "."):
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def layer(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    if module == "runner":  # the package's own __init__: the environment, before anything
        return 0
    raise AssertionError(f"{module}: in no layer; add its package to LAYERS and the docs")


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert circles(graph()) == []


def test_no_import_runs_up_a_layer():
    upward = [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in graph().items()
        for b in sorted(targets)
        if layer(b) > layer(a)
    ]
    assert upward == []


def test_every_module_is_in_a_layer_and_says_what_it_is_for():
    for name, path in modules().items():
        layer(name)
        tree = ast.parse(path.read_text())
        if path.name != "__init__.py" or tree.body:
            assert ast.get_docstring(tree), f"{path.relative_to(REPO)}: no module docstring"


def test_no_module_is_over_300_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in modules().items()}
    assert {n: lines for n, lines in long.items() if lines > LIMIT} == {}


def test_the_checks_find_a_circle_and_an_upward_import(tmp_path):
    """The checks themselves can fail: a circle and an arrow up, made on purpose."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    (tmp_path / "m.py").write_text("def f():\n    from runner.train.pipeline import run\n")
    found = imports("runner.measure.m", tmp_path / "m.py", {"runner.train.pipeline"})
    assert found == {"runner.train.pipeline"}
    assert layer("runner.train.pipeline") > layer("runner.measure.m")
