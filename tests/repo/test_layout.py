"""The package's shape: small modules with one job (no file of pipeline/ or actors/ over 400
lines)."""

from __future__ import annotations

from support.paths import REPO

PIPELINE = REPO / "pipeline"
ACTORS = REPO / "actors"
MAX_LINES = 400


def test_no_file_in_pipeline_is_over_400_lines():
    sizes = {str(p.relative_to(PIPELINE)): len(p.read_text().splitlines())
             for p in PIPELINE.rglob("*.py")}
    assert sizes  # the walk found the package
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}


def test_no_file_in_actors_is_over_400_lines():
    """actors/ holds thin Ray shells; their logic lives in pipeline/."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in ACTORS.rglob("*.py")}
    assert "engine.py" in sizes
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}
