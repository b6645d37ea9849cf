"""Where things are, for tests that open repository files: one place to change when tests move."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/support/paths.py -> the repository root
ROOT = str(REPO)
TESTS = REPO / "tests"
