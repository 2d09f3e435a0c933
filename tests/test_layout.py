"""The layout rules of the library (DESIGN's "Layout"): folders that show their concerns and imports that
run one way and never in a circle. Modules are sized by concern, not by a line count: no limit is a gate."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# repository folder -> the installed package it becomes (pyproject.toml's package-dir)
LIBRARY = {"specaudit": "specaudit", "engines": "specaudit.engines", "equivalence": "specaudit.equivalence",
           "bench": "specaudit.bench", "property_tests": "specaudit.testing", "fixtures": "specaudit.fixtures"}
MAX_MODULES_PER_FOLDER = 15


def _modules() -> dict[str, Path]:
    """Installed module name -> file, for every library module."""
    found = {}
    for folder, package in LIBRARY.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, name: str) -> set[str]:
    """The specaudit modules `path` imports (at any depth: lazy imports count too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    known = _modules()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {module for module in out if module in known and module != name}


def test_every_library_folder_is_small() -> None:
    folders: dict[Path, int] = {}
    for name, path in _modules().items():
        if path.name != "__init__.py":
            folders[path.parent] = folders.get(path.parent, 0) + 1
    crowded = {str(folder.relative_to(ROOT)): count for folder, count in folders.items()
               if count > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules: {crowded}"


def test_imports_run_one_way_without_circles() -> None:
    modules = _modules()
    graph = {name: _imports(path, name) for name, path in modules.items()}
    for name, targets in graph.items():
        if name.startswith("specaudit.engines"):
            wrong = {t for t in targets if t.startswith(("specaudit.equivalence", "specaudit.bench"))}
            assert not wrong, f"{name} (engines) imports {sorted(wrong)}: engines never import the harness"
        if name.startswith("specaudit.engines") and not name.startswith("specaudit.engines.models"):
            wrong = {t for t in targets if t.startswith("specaudit.engines.models")}
            assert not wrong, f"{name} imports {sorted(wrong)}: the algorithms never load models"
        if name.startswith("specaudit.equivalence"):
            wrong = {t for t in targets if t.startswith("specaudit.bench")}
            assert not wrong, f"{name} imports {sorted(wrong)}: the audit never imports the bench"
    # package __init__ modules are excluded as nodes: a package importing its own children is not a circle
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if target not in graph or modules[target].name == "__init__.py":
                continue
            if state.get(target) == 1:
                cycle = stack[stack.index(target):] + [target] if target in stack else [node, target]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if not state.get(target):
                visit(target, stack + [target])
        state[node] = 2

    for name in graph:
        if not state.get(name) and modules[name].name != "__init__.py":
            visit(name, [name])


def test_zoo_and_bench_pair_do_not_import_each_other() -> None:
    modules = _modules()
    zoo, bench_pair = "specaudit.engines.models.zoo", "specaudit.engines.models.bench_pair"
    assert bench_pair not in _imports(modules[zoo], zoo)
    assert zoo not in _imports(modules[bench_pair], bench_pair)


def test_charts_are_drawn_by_matplotlib_not_by_hand() -> None:
    charts = _modules()["specaudit.equivalence.reports.charts"].read_text(encoding="utf-8")
    assert re.search(r"^\s*(from|import) matplotlib", charts, re.M)
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        hand_drawn = re.findall(r"<(rect|line|polyline|polygon|circle|path|text)\b[^>]*\{", text)
        assert not hand_drawn, f"{name} builds SVG shapes by hand: {hand_drawn[:3]}"
