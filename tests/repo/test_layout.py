"""The package's shape: small modules with one job (no file of pipeline/ over 400 lines)."""

from __future__ import annotations

from support.paths import REPO

PIPELINE = REPO / "pipeline"
MAX_LINES = 400


def test_no_file_in_pipeline_is_over_400_lines():
    sizes = {str(p.relative_to(PIPELINE)): len(p.read_text().splitlines())
             for p in PIPELINE.rglob("*.py")}
    assert sizes  # the walk found the package
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}
