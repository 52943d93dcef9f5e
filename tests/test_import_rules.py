"""The rooms' import rules from the architecture page, enforced on the source of every package.

An import counts wherever it stands (module level or inside a function: an import inside a
function still runs, it only runs later), except under `if TYPE_CHECKING:`, which never runs.
Three rules: each room imports only the rooms it may; only the wiring imports dagster; nothing
but `benchmarks/` and `tests/` imports `benchmarks` (not even through an importlib string), so
the code location never loads it. And no import circles (issue 25).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
# Every top-level package: a folder with an __init__.py. A new one must get a rule below.
PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
PRODUCT = {"assets", "sensors", "pipelines", "controllers", "cloud", "training", "telemetry",
           "rl", "trainwise"}
DAGSTER_ROOMS = {"assets", "sensors", "pipelines"}
# Leaves any room may read: they import nothing of ours but each other (checked below).
LEAVES = {"trainwise.settings", "trainwise.services", "trainwise.tracking"}
# room -> rooms (or single modules) of ours it may import; itself and LEAVES always allowed.
ALLOWED: dict[str, set[str]] = {
    "controllers": set(),
    "telemetry": set(),
    "cloud": {"controllers"},
    "rl": {"controllers", "cloud"},
    # The learned fast policy runs inside the training loop (the DDP worker loads it).
    "training": {"controllers", "telemetry", "rl.fast_obs", "rl.fast_path", "rl.policy_file"},
    # The application layer; its CLI also starts the Dagster UI (`trainwise ui`).
    "trainwise": {"controllers", "cloud", "training", "telemetry", "rl", "pipelines.ui",
                  "pipelines.headless"},
    "assets": PRODUCT,
    "sensors": PRODUCT,
    "pipelines": PRODUCT,
    "benchmarks": PRODUCT,
    "tests": PRODUCT | {"benchmarks"},
}
# Crossings the rules do not allow, each with why; issue 25 removes them. A new one fails.
KNOWN_CROSSINGS: set[tuple[str, str]] = set()
# No import circle is allowed (issue 25 removed the last two); the finder is tested below.
KNOWN_CIRCLES: tuple[frozenset[str], ...] = ()
IMPORTLIB_CALLS = {"import_module", "__import__", "run_module"}


@dataclass(frozen=True)
class Import:
    target: str  # dotted name as written, resolved when relative
    line: int
    dynamic: bool = False  # an importlib string, not an import statement


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> list[Import]:
    """Every import in the file, module level or not, plus string arguments of importlib calls."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[Import] = []
    # A module name right after "-m" in a command list starts that module as its own program
    # (`[sys.executable, "-m", "benchmarks.run_all"]`): a process boundary, not an import.
    programs = {id(item) for node in ast.walk(tree) if isinstance(node, ast.List | ast.Tuple)
                for flag, item in zip(node.elts, node.elts[1:])
                if isinstance(flag, ast.Constant) and flag.value == "-m"}
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if id(node) in programs:
            continue
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from a import b` may import the module a.b; resolution below decides.
            found += [Import(f"{base}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0] if node.args else None
            if (name in IMPORTLIB_CALLS and isinstance(first, ast.Constant)
                    and isinstance(first.value, str)):
                found.append(Import(first.value, node.lineno, dynamic=True))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # A bare dotted name of a benchmark module is an importlib target in waiting (a
            # table of suites to import_module); doc text with paths or commands is not.
            text = node.value
            if text.startswith("benchmarks.") and text.replace(".", "").replace("_", "").isalnum():
                found.append(Import(text, node.lineno, dynamic=True))
        stack.extend(ast.iter_child_nodes(node))
    return found


MODULES = {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _resolve(target: str) -> str | None:
    """The module of ours an import loads (longest dotted prefix that is one), or None."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _room(module: str) -> str:
    return module.split(".")[0]


def _allowed(source: str, target: str) -> bool:
    room = _room(source)
    if _room(target) == room or target in LEAVES:
        return True
    return any(target == entry or target.startswith(entry + ".") for entry in ALLOWED[room])


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {_resolve(i.target) for i in _imports(path) if not i.dynamic}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(component)
    return circles


def test_every_package_has_a_rule():
    assert set(PACKAGES) == PRODUCT | {"benchmarks", "tests"}, "a new package needs a rule"
    assert set(ALLOWED) == set(PACKAGES)


@pytest.mark.parametrize("room", sorted(set(PACKAGES) - DAGSTER_ROOMS - {"tests"}))
def test_only_wiring_rooms_import_dagster(room):
    offenders = [f"{m}:{i.line}" for m, p in MODULES.items() if _room(m) == room
                 for i in _imports(p)
                 if i.target.split(".")[0] == "dagster" or i.target.startswith("dagster_")]
    assert offenders == [], f"dagster imported outside assets/sensors/pipelines: {offenders}"


@pytest.mark.parametrize("room", PACKAGES)
def test_rooms_import_only_what_they_may(room):
    bad = []
    for module, path in MODULES.items():
        if _room(module) != room:
            continue
        for item in _imports(path):
            target = _resolve(item.target)
            if target and not _allowed(module, target) and (module, target) not in KNOWN_CROSSINGS:
                bad.append(f"{module}:{item.line} imports {target}")
    assert bad == []


def test_leaves_import_nothing_of_ours_but_leaves():
    for leaf in LEAVES:
        targets = {_resolve(i.target) for i in _imports(MODULES[leaf])} - {None, leaf}
        assert targets <= LEAVES, f"{leaf} is no leaf: it imports {targets - LEAVES}"


def test_nothing_but_benchmarks_and_tests_imports_benchmarks():
    bad = [f"{module}:{item.line} {'names' if item.dynamic else 'imports'} {item.target}"
           for module, path in MODULES.items() if _room(module) not in ("benchmarks", "tests")
           for item in _imports(path)
           if _room(item.target) == "benchmarks"
           and (module, _resolve(item.target) or item.target) not in KNOWN_CROSSINGS]
    assert bad == []


def test_no_new_import_circles():
    new = [sorted(c) for c in _circles(_graph()) if not any(c <= known for known in KNOWN_CIRCLES)]
    assert new == [], f"import circles (issue 25 forbids them): {new}"


def test_loading_the_code_location_imports_no_benchmark_and_no_torch():
    """What Dagster loads (workspace.yaml), in a fresh interpreter: no `benchmarks` module, and
    not torch (1.3 s of every code-location load, every UI reload and every run process, when
    the node agent's launcher pulled it in through `trainwise.sdk`); a run that trains imports
    it then."""
    workspace = yaml.safe_load((ROOT / "workspace.yaml").read_text())
    modules = [entry["python_module"]["module_name"] for entry in workspace["load_from"]]
    assert modules
    probe = ("import importlib, json, sys\n"
             f"for name in {modules!r}:\n"
             "    importlib.import_module(name)\n"
             "print(json.dumps(sorted(m for m in sys.modules\n"
             "                        if m.split('.')[0] in ('benchmarks', 'torch'))))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_rule_checker_sees_imports(tmp_path, monkeypatch):
    # The checker must find every import form, or the rules above would pass vacuously.
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    package = tmp_path / "pkg"
    package.mkdir()
    sample = package / "x.py"
    sample.write_text(
        "import dagster as dg\nfrom cloud.prices import x\nfrom . import y\nfrom .z import w\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rl import hidden\n"
        "def f():\n    import importlib\n    from benchmarks.cost import suite\n"
        "    return importlib.import_module('benchmarks.run_all')\n"
        "SUITES = {'cost': 'benchmarks.cost'}\nDOC = 'run `python -m benchmarks.data`'\n")
    found = {(i.target, i.dynamic) for i in _imports(sample)}
    assert found == {("dagster", False), ("cloud.prices.x", False), ("pkg.y", False),
                     ("pkg.z.w", False), ("typing.TYPE_CHECKING", False), ("importlib", False),
                     ("benchmarks.cost.suite", False), ("benchmarks.run_all", True),
                     ("benchmarks.cost", True)}


def test_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _circles(graph) == [{"a", "b", "c"}]
