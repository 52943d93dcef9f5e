"""The rooms' import rules from the architecture page, enforced on the source."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = {"assets", "sensors", "pipelines", "controllers", "cloud", "training", "telemetry",
        "benchmarks", "trainwise"}
# room -> rooms of ours it may import (itself always allowed). `trainwise` (CLI, settings, the
# run orchestration) and `benchmarks` sit on top and may import every room, but not dagster.
ALLOWED = {
    "controllers": set(),
    "cloud": {"controllers"},
    "training": {"controllers", "telemetry"},
    "telemetry": set(),
}
DAGSTER_ROOMS = {"assets", "sensors", "pipelines"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "trainwise.settings" or (
                node.module == "trainwise" and {a.name for a in node.names} == {"settings"}
            ):
                # trainwise.settings is a leaf (it imports nothing of ours): any room may read
                # its settings through it.
                continue
            names.add(node.module.split(".")[0])
    return names


def _files(room: str) -> list[Path]:
    return sorted((ROOT / room).rglob("*.py"))


@pytest.mark.parametrize("room", sorted(OURS - DAGSTER_ROOMS))
def test_only_wiring_rooms_import_dagster(room):
    offenders = [str(p.relative_to(ROOT)) for p in _files(room)
                 if any(n == "dagster" or n.startswith("dagster_") for n in _imports(p))]
    assert offenders == [], f"dagster imported outside assets/sensors/pipelines: {offenders}"


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_rooms_import_only_what_they_may(room):
    bad = []
    for path in _files(room):
        for name in _imports(path) & OURS:
            if name != room and name not in ALLOWED[room]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


def test_rule_checker_sees_imports(tmp_path):
    # The checker must find both import forms, or the rules above would pass vacuously.
    sample = tmp_path / "x.py"
    sample.write_text("import dagster as dg\nfrom cloud.prices import x\nfrom . import y\n"
                      "from trainwise import settings\nfrom trainwise import runs\n")
    assert _imports(sample) == {"dagster", "cloud", "trainwise"}
