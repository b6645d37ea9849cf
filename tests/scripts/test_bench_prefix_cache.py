"""Smoke test of scripts/bench_prefix_cache.py on the tiny model (seconds; no timing asserted):
the conversation runs through the real HTTP server with the cache on and off, answers alike, and
each later turn reports the previous turn's prompt as cached."""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest
from support.paths import ROOT

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]


def test_bench_prefix_cache_runs_and_reports_cached_turns(capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_prefix_cache", os.path.join(ROOT, "scripts", "bench_prefix_cache.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--turns", "3",
                          "--max-tokens", "4", "--tools", "2", "--max-model-len", "2048"])
    on, off = results["on"], results["off"]
    assert [t["text"] for t in on] == [t["text"] for t in off]
    assert [t["cached"] for t in off] == [0, 0, 0] and on[0]["cached"] == 0
    for prev, cur in itertools.pairwise(on):
        assert cur["cached"] >= 0.8 * prev["prompt"]
    assert all(t["ttft"] is not None for t in on + off)
    assert "answers identical with caching on and off: True" in capsys.readouterr().out
