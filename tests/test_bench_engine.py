"""Smoke test of scripts/bench_engine.py on the tiny random model (a few seconds, no Ray, no HF)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_module():
    spec = importlib.util.spec_from_file_location(
        "bench_engine", os.path.join(ROOT, "scripts", "bench_engine.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_engine", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_bench_runs_every_mode_and_greedy_outputs_agree(tmp_path):
    bench = _bench_module()
    rc = bench.main(["--model", "tiny:0", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                     "--plan", "copy:1,2", "--max-tokens", "6", "--ray-batches", "--no-hf",
                     "--no-plots", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0 and report["identical_greedy_outputs"] is True
    runs = {(r["mode"], r["batch"]) for r in report["runs"]}
    assert runs == {(m, b) for m in ("none", "ngram", "model") for b in (1, 2)}
    for r in report["runs"]:
        assert r["output_tokens"] > 0 and r["tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0
        assert set(r["breakdown_ms"]) >= {"draft_forward", "verify_forward", "output", "other"}
