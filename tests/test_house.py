"""The shape of the house, held by tests: the tests stand on their own (nothing under tests/ reaches into
bench/), and no module of the package grows past 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

BENCH_MODULES = {p.stem for p in (REPO / "bench").glob("*.py")}
MAX_LINES = 400


def bench_reaches(path: Path) -> list[str]:
    """Where a Python file imports a module of bench/ or puts bench/ on the import path."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in BENCH_MODULES | {"bench"}]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in BENCH_MODULES | {"bench"}:
                found.append(f"from {node.module}")
        elif isinstance(node, ast.Constant) and node.value == "bench" and _in_path_call(tree, node):
            found.append("bench/ on sys.path")
    return [f"{path.name}: {what}" for what in found]


def _in_path_call(tree: ast.AST, constant: ast.Constant) -> bool:
    for call in ast.walk(tree):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "insert"
                and any(constant in ast.walk(arg) for arg in call.args)):
            return True
    return False


def test_nothing_under_tests_reaches_into_bench() -> None:
    reaches = [r for path in sorted((REPO / "tests").rglob("*.py")) for r in bench_reaches(path)]
    assert not reaches, reaches


def test_the_check_sees_a_reach_into_bench(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('import sys\nsys.path.insert(0, str(REPO / "bench"))\nfrom accuracy import judge\n')
    assert len(bench_reaches(probe)) == 2
    probe.write_text("from tests.traces.judge import judge\n")
    assert bench_reaches(probe) == []


def test_no_module_of_the_package_is_over_400_lines() -> None:
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in (REPO / "watchdog").rglob("*.py")}
    assert len(sizes) > 100, "the package's modules were not found"
    assert not {path: n for path, n in sizes.items() if n > MAX_LINES}, sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
