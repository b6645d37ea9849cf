"""scripts/bench_step_messages.py runs end to end at a tiny size (its numbers are reported in
docs/benchmarks.md, never asserted): every step message and the deltas, with their bytes."""

from __future__ import annotations

import json
import subprocess
import sys

from support.serve_helpers import ROOT


def test_bench_step_messages_reports_every_message():
    out = subprocess.run([sys.executable, "scripts/bench_step_messages.py", "--batches", "2",
                          "--delta-batches", "1", "3", "--repeats", "10", "--vocab", "64"],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert set(rows[0]["tree"]) == {"commit", "dirty", "dirty_files"}
    timed = {(r["batch"], r["message"]) for r in rows[1:] if "encode_us" in r}
    assert timed == {(2, "plan"), (2, "proposal"), (2, "outcome"), (2, "proposal+q"),
                     (1, "deltas"), (1, "deltas+top5"), (3, "deltas"), (3, "deltas+top5")}
    assert all(r["bytes"] > 0 and r["encode_us"] > 0 and r["decode_us"] > 0
               for r in rows[1:] if "encode_us" in r)
