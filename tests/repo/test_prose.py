"""pipeline/ says what the code does not: at most 12 comment and docstring lines per 100 code lines,
counted by scripts/prose_ratio.py."""

from __future__ import annotations

import os
import sys

from support.paths import REPO

sys.path.insert(0, str(REPO / "scripts"))

import prose_ratio

MAX_PROSE_PER_100_CODE_LINES = 12.0


def test_pipeline_carries_at_most_12_prose_lines_per_100_code_lines():
    files = prose_ratio.python_files(os.path.join(REPO, "pipeline"))
    counts = sum((prose_ratio.count_file(f) for f in files), prose_ratio.Counts())
    assert counts.code > 5000  # the walk found the package
    assert counts.ratio <= MAX_PROSE_PER_100_CODE_LINES, prose_ratio.report(counts, "pipeline")
