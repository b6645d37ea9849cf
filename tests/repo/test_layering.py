"""The arrows between packages point one way: the stages, the models and the protocol never
import the engine (the wiring on top), and nothing in pipeline/ imports Ray (actors/ wraps it).
Read from the source (AST), lazy imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.paths import REPO as ROOT

PIPELINE = ROOT / "pipeline"
BELOW_ENGINE = ["config.py", "draft", "verify", "grammar", "models", "output", "frontend",
                "tracing", "protocol"]


def modules(*parts: str) -> list[Path]:
    out = []
    for part in parts:
        path = PIPELINE / part
        out += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return out


def imported(path: Path) -> set[str]:
    """Every module name `path` imports (`from a import b` counts as a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("path", modules(*BELOW_ENGINE), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_stage_model_or_protocol_module_imports_the_engine(path):
    rel = str(path.relative_to(ROOT))
    upward = {n for n in imported(path) if under(n, "pipeline.engine")}
    assert not upward, f"{rel} imports {sorted(upward)}"


@pytest.mark.parametrize("path", modules("."), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_in_pipeline_imports_ray(path):
    assert not {n for n in imported(path) if under(n, "ray")}


def test_the_checks_see_imports(tmp_path):
    """The walk finds top-level, lazy and `from` imports (so the tests above can fail)."""
    src = tmp_path / "m.py"
    src.write_text("import ray\ndef f():\n    from pipeline.engine import core\n")
    names = imported(src)
    assert "ray" in names and "pipeline.engine.core" in names
    assert under("pipeline.engine.core", "pipeline.engine") and not under("rayx", "ray")
