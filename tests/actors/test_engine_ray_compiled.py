"""The engine on Ray with `step_transport: compiled` (actors/compiled_stages.py; the plain-call
transport has the same tests in test_engine_ray.py): each step is one execution of a compiled
graph (draft -> every verifier rank). Greedy output equals target only's at TP=1 (a draft model
at fixed k) and TP=2 (n-grams, prompts chunked); abort frees the slots; a killed draft actor or
verifier rank fails the in-flight requests within seconds with the graph's error, and the engine
rebuilds its stages, recompiles the graph and serves the same greedy output again."""

from __future__ import annotations

import asyncio

import pytest
from support.engine_cases import PROMPTS, expected_cut, ids, mixed_requests
from support.ray_engine import (
    abort_mid_stream,
    greedy_references,
    kill_during_generation,
    run_batch,
    start_tp_engines,
    wait_healthy,
)

from actors.engine import stop_engine
from actors.engine_client import EngineClient
from pipeline.errors import EngineDeadError

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

COMPILED = {"step_transport": "compiled"}


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    return greedy_references()


@pytest.fixture(scope="module")
def engines(ray_cluster):
    handles = start_tp_engines(COMPILED)
    yield handles
    for h in handles.values():
        stop_engine(h)


def check_greedy(handle, reference, n: int = 8) -> None:
    requests = mixed_requests(n)
    out = run_batch(handle, requests)
    for rid, prompt, params in requests:
        want_ids, want_text = expected_cut(reference[PROMPTS.index(prompt)], params)
        deltas = out[rid]
        assert ids(deltas) == want_ids
        assert "".join(d.text for d in deltas) == want_text
        assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
def test_compiled_engine_greedy_equals_target_only(engines, reference, tp):
    check_greedy(engines[tp], reference)
    stats = asyncio.run(EngineClient(engines[tp]).stats())
    assert stats["num_draft_tokens"] > 0 and stats["healthy"]


def test_compiled_abort_ends_stream_and_frees_slots(engines):
    got, stats = abort_mid_stream(engines["tp1"])
    assert got[-1].finish_reason == "abort" and len(ids(got)) < 200
    assert stats["free_slots"] == stats["num_slots"] == 8 and stats["healthy"]


@pytest.mark.parametrize(("tp", "which"), [("tp1", "draft"), ("tp2", "verifier")])
def test_compiled_killed_stage_fails_requests_fast_then_rebuilds_and_recompiles(
        engines, reference, tp, which):
    handle = engines[tp]
    results, elapsed = asyncio.run(kill_during_generation(handle, which))
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "compiled step graph failed" in str(results[0])  # the graph saw the death
    assert elapsed < 10
    assert asyncio.run(EngineClient(handle).health())["healthy"] is False
    # New stage actors, a new graph over them, and the same greedy output.
    assert wait_healthy(handle)["healthy"]
    check_greedy(handle, reference, n=4)
    assert asyncio.run(EngineClient(handle).stats())["restarts"] == 1
