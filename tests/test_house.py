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


# The composition root, the entry points and the demo: everything else lives in a folder that says its floor.
TOP_LEVEL = {"__init__", "__main__", "entry", "daemon", "service", "demo", "demo_rank"}


def test_nothing_sits_loose_at_the_top_of_the_package() -> None:
    loose = {p.stem for p in (REPO / "watchdog").glob("*.py")} - TOP_LEVEL
    assert not loose, f"give these a folder that says their floor: {sorted(loose)}"


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at its top or inside a function (a deferred import is an
    import all the same: the two modules cannot be understood apart)."""
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                targets = [f"{node.module}.{a.name}" for a in node.names]
                graph[name] |= {t for t in targets if t in modules} or {node.module}
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_modules_import_each_other() -> None:
    assert not cycles(import_graph(REPO / "watchdog"))


def test_the_cycle_check_sees_a_deferred_import(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import a\n")
    assert cycles(import_graph(tmp_path / "pkg")) == [["pkg.a", "pkg.b"]]
