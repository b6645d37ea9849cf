"""scripts/bench_step_overhead.py runs end to end in-process at a tiny size (its numbers are
reported in docs/benchmarks.md, never asserted): every part of a step timed, outputs checked."""

from __future__ import annotations

import json
import subprocess
import sys

from support.serve_helpers import ROOT


def test_bench_step_overhead_times_each_part_of_a_step(tmp_path):
    out = subprocess.run([sys.executable, "scripts/bench_step_overhead.py", "--transports",
                          "inproc", "--batches", "1", "4", "--reps", "2", "--tokens", "8",
                          "--draft", "ngram", "--out", str(tmp_path)],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["cells"]) == {"inproc/b1", "inproc/b4"}
    assert set(result["tree"]) == {"commit", "dirty", "dirty_files"}
    for cell in result["cells"].values():
        assert cell["bad_outputs"] == 0 and cell["steps"] >= 8 and cell["step_ms"] > 0
        parts = cell["parts_ms"]
        assert set(parts) == {"schedule", "draft", "verify", "forward", "output", "loop"}
        assert parts["verify"] > 0 and parts["output"] > 0
    assert "| 4 | inproc |" in out.stdout
