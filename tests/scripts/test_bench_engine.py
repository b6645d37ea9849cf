"""Smoke test of scripts/bench_engine.py on the tiny random model (a few seconds, no Ray, no HF)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

from pytest import approx
from support.paths import ROOT


def _bench_module():
    spec = importlib.util.spec_from_file_location(
        "bench_engine", os.path.join(ROOT, "scripts", "bench_engine.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_engine", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_bench_runs_every_mode_interleaved_and_checks_outputs_and_statistics(tmp_path):
    bench = _bench_module()
    rc = bench.main(["--model", "tiny:0", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                     "--plan", "copy:1,2", "--max-tokens", "6", "--reps", "2", "--reps-b1", "3",
                     "--requests", "4",
                     "--warm", "copy:2",
                     "--no-hf", "--no-plots", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0
    assert report["greedy_equals_reference"] is True and report["num_reference_mismatches"] == 0
    # per mode: 1 request in each of 3 batch-1 repetitions, 4 in each of 2 at batch 2 (2 in
    # flight, closed loop)
    assert report["stats_identity_holds"] is True and report["requests_checked"] == 5 * (3 + 2 * 4)
    assert isinstance(report["meta"]["dirty"], bool) and report["meta"]["commit"]
    runs = {(r["mode"], r["batch"]) for r in report["runs"]}
    assert runs == {(m, b) for m in ("none", "adaptive", "k2", "k4", "k8") for b in (1, 2)}
    for r in report["runs"]:
        assert len(r["rep_tokens_per_s"]) == (3 if r["batch"] == 1 else 2)
        assert r["spread"] is not None
        assert r["output_tokens"] > 0 and r["tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0
        assert set(r["breakdown_ms"]) >= {"draft_forward", "verify_forward", "output", "other"}
    cell = report["targets"]["copy/b2"]
    assert "adaptive_vs_best_fixed (>= 0.97)" in cell and cell["adaptive_vs_best_fixed_paired"] > 0
    assert cell["adaptive_vs_none_paired"] > 0
    # pooled: all tokens over all wall time, per mode, recomputed from the runs' totals
    rate = {r["mode"]: r["output_tokens"] / r["wall_s"] for r in report["runs"] if r["batch"] == 2}
    assert cell["adaptive_vs_none_pooled"] == approx(rate["adaptive"] / rate["none"])
    assert cell["adaptive_vs_best_fixed_pooled"] == approx(
        min(rate["adaptive"] / rate[k] for k in ("k2", "k4", "k8")))
    for r in report["runs"]:  # batch 1, one request a repetition: no busy window
        assert (r["busy_tokens_per_s"] is None) == (r["batch"] == 1)
        assert len(r["rep_busy_tokens_per_s"]) == (2 if r["batch"] == 2 else 0)
    assert cell["busy: adaptive_vs_none_paired"] > 0


def test_batch_1_modes_take_turns_request_by_request(tmp_path, monkeypatch):
    bench = _bench_module()
    calls = []
    run_wave = bench.LocalBench.run_wave

    def spy(self, mode, wave, params, batch=None):
        calls.append((mode, [r.rid for r in wave], batch))
        return run_wave(self, mode, wave, params, batch)

    monkeypatch.setattr(bench.LocalBench, "run_wave", spy)
    modes = ["none", "adaptive", "k4"]
    rc = bench.main(["--model", "tiny:0", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                     "--plan", "copy:1,2", "--modes", *modes, "--max-tokens", "4",
                     "--reps", "2", "--reps-b1", "2", "--requests-b1", "2", "--requests", "3",
                     "--no-hf", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    timed = calls[len(modes):]  # after each mode's warm-up wave
    b1, b2 = timed[:4 * len(modes)], timed[4 * len(modes):]
    # batch 1: 2 repetitions x 2 requests = 4 turns, each of one request served by every mode,
    # the first mode of a turn rotating
    for turn in range(4):
        group = b1[turn * len(modes):(turn + 1) * len(modes)]
        assert [m for m, _, _ in group] == modes[turn % 3:] + modes[:turn % 3]
        assert len({tuple(rids) for _, rids, _ in group}) == 1 and len(group[0][1]) == 1
    assert len({tuple(rids) for _, rids, _ in b1}) == 4
    # batch 2: one turn of the whole closed loop per repetition, rotated per repetition
    assert [(m, len(rids), b) for m, rids, b in b2] == [
        (m, 3, 2) for m in modes + modes[1:] + modes[:1]]
    report = json.loads((tmp_path / "results.json").read_text())
    for r in report["runs"]:  # a batch-1 repetition's rate is over both its turns
        assert len(r["rep_tokens_per_s"]) == 2
        assert r["requests"] == (4 if r["batch"] == 1 else 6)


def test_the_busy_window_ends_at_the_last_submission():
    _bench_module()  # puts the repository root on sys.path, as a run of the script does
    from scripts.engine_bench.traces import Trace as trace
    from scripts.engine_bench.traces import busy_window

    # 2 in flight: a and b at t=0; c when a ends (t=3), d when b ends (t=5)
    traces = [trace("a", 0.0, [1.0, 2.0, 3.0], [1, 2, 1], [0] * 4),
              trace("b", 0.0, [1.0, 5.0], [1, 3], [0] * 4),
              trace("c", 3.0, [4.0, 6.0], [1, 1], [0] * 2),
              trace("d", 5.0, [5.5, 9.0], [2, 2], [0] * 4)]
    # up to t=5: a's 4, b's 4, c's first 1 (t=4)
    assert busy_window(traces) == (9, 5.0)
    assert busy_window(traces[:2]) == (0, 0.0)  # one wave: submitted at once


def test_a_greedy_output_that_differs_from_the_reference_fails_the_run(tmp_path, monkeypatch):
    bench = _bench_module()
    real = bench.reference_outputs

    def shifted(*args, **kwargs):
        return {k: [t + 1 for t in v] for k, v in real(*args, **kwargs).items()}

    monkeypatch.setattr(bench, "reference_outputs", shifted)
    rc = bench.main(["--model", "tiny:0", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                     "--plan", "copy:1", "--modes", "none", "--max-tokens", "4", "--reps", "1",
                     "--no-hf", "--no-plots", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    assert rc == 1 and report["greedy_equals_reference"] is False
