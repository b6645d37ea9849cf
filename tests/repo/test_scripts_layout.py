"""scripts/ is benchmark entry points over one harness: no file of it over 400 lines, every
bench script on scripts/harness.py, and none keeping its own copy of the harness's machinery."""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import REPO

SCRIPTS = REPO / "scripts"
HARNESS = SCRIPTS / "harness.py"
MAX_LINES = 400


def python_files() -> list[Path]:
    return sorted(p for p in SCRIPTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_file_in_scripts_is_over_400_lines():
    sizes = {str(p.relative_to(SCRIPTS)): len(p.read_bytes().splitlines())
             for p in SCRIPTS.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert {"bench_engine.py", "engine_bench/results.py", "harness.py"} <= set(sizes)
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_every_bench_script_runs_on_the_harness():
    benches = sorted(SCRIPTS.glob("bench_*.py"))
    assert len(benches) >= 10
    assert [p.name for p in benches if "scripts.harness" not in imports(p)] == []


def defined(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_no_script_keeps_its_own_copy_of_the_harness():
    """The harness's functions (tree state, percentiles, process CPU time, servers' ports and
    health, ...) are defined there only."""
    shared = {name for name in defined(HARNESS) if not name.startswith("_")}
    assert {"tree_state", "percentile", "tree_cpu_s", "free_port", "wait_healthy"} <= shared
    copies = {str(p.relative_to(SCRIPTS)): sorted(defined(p) & shared)
              for p in python_files() if p != HARNESS}
    assert {p: names for p, names in copies.items() if names} == {}
