"""The commit and working-tree state a benchmark ran on, for its report."""
from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False)
    except OSError:
        return ""
    return done.stdout.strip()


def tree_state() -> dict[str, object]:
    """{"commit": short hash or "", "dirty": bool, "dirty_files": tracked files changed}."""
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(dirty),
            "dirty_files": dirty.splitlines()}
