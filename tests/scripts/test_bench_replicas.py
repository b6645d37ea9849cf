"""Smoke test of scripts/bench_replicas.py on the tiny model (no timing asserted): one and two
engine replicas serve the same interleaved waves with outputs equal to the single engine's, every
run is measured (tokens, wall and CPU time), and the ingress -> replica hop is measured."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from support.paths import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def load_bench(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "bench_replicas", os.path.join(ROOT, "scripts", "bench_replicas.py"))
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_replicas", bench)  # its dataclasses look it up
    spec.loader.exec_module(bench)
    return bench


def test_bench_replicas_runs_both_apps_and_checks_outputs(ray_cluster, capsys, tmp_path,
                                                          monkeypatch):
    bench = load_bench(monkeypatch)
    out = tmp_path / "replicas.json"
    result = bench.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--reps", "2",
                         "--requests", "8", "--concurrency", "4", "--max-tokens", "8",
                         "--hop-requests", "4", "--out", str(out)])
    assert result["mismatches"] == []
    runs = result["runs"]
    assert [(r["replicas"], r["rep"]) for r in runs] == [(1, 0), (2, 0), (1, 1), (2, 1)]
    assert all(r["tokens"] == 8 * 8 and r["failed"] == 0 and r["cpu_s"] > 0 for r in runs)
    assert result["summary"]["speedup_median"] > 0
    for name in ("engine_ttft", "handle_ttft", "http_ttft", "hop_call_added"):
        assert 0 < result["hop"][name]["p50_ms"] <= result["hop"][name]["p99_ms"]
    hop = result["hop"]
    for q in ("p50_ms", "p99_ms"):  # the shift is of the two distributions, not of the pairs
        assert hop["ttft_shift"][q] == pytest.approx(hop["handle_ttft"][q] - hop["engine_ttft"][q])
    assert set(result["meta"]) >= {"commit", "dirty", "dirty_files", "date"}
    assert out.is_file()
    printed = capsys.readouterr().out
    assert "speedup 2 vs 1 replica" in printed and "ingress -> replica hop adds" in printed


def test_bench_replicas_says_what_the_cluster_lacks_instead_of_waiting(ray_cluster, monkeypatch):
    load_bench(monkeypatch)  # puts the repository root on sys.path, as a run of the script does
    from scripts.replicas_bench.apps import wait_for_resources

    with pytest.raises(RuntimeError, match=r"9 engines need \{'CPU': 9\.0\}"):
        wait_for_resources(os.path.join(ROOT, "configs", "tiny.yaml"), {}, 9, timeout=1)
