"""scripts/bench_output.py runs end to end at a tiny size (its numbers are reported in notes and
docs/benchmarks.md, never asserted): the untraced rates and the paired tracing comparison."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from support.serve_helpers import ROOT

SMALL = ["--requests", "8", "--steps", "3", "--repeats", "2", "--skip-scaling"]


@pytest.mark.parametrize("extra", [["--gc", "default"], ["--trace-overhead", "--trace-ratio", "0.5"],
                                   ["--trace-overhead", "--trace-export", "otlp"],
                                   ["--trace-overhead", "--actor-step"]])
def test_bench_output_runs_and_reports_rates(extra):
    out = subprocess.run([sys.executable, "scripts/bench_output.py", *SMALL, *extra], check=False,
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    gc_mode = "default" if "--gc" in extra else "tuned"
    assert re.fullmatch(rf"8 requests x 5-token windows, GC {gc_mode}, commit \S+( \(dirty\))?",
                        lines[0]), lines[0]
    if "--trace-overhead" in extra:
        scope = ", actor step (process + encode deltas)" if "--actor-step" in extra else ""
        assert [ln.split(":")[0] for ln in lines[1:]] == [f"tracing overhead, ids{scope}",
                                                          f"tracing overhead, text{scope}"]
        pct = r"[+-]\d+\.\d%"
        assert all(re.search(rf"over 4 pairs: {pct} to {pct}, wall {pct}, median {pct} CPU$", ln)
                   for ln in lines[1:]), lines
    else:
        rates = [float(m.group(1).replace(",", ""))
                 for m in map(re.compile(r": ([\d,]+) accepted tokens/s").search, lines[1:]) if m]
        assert len(rates) == 2 and all(r > 0 for r in rates), lines
