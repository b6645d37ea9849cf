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
from support.ray_engine import kill_during_generation, run_batch, wait_healthy
from support.reference_decode import greedy_reference

from actors.engine import start_engine, stop_engine
from actors.engine_client import EngineClient
from pipeline.config import load_config
from pipeline.errors import EngineDeadError
from pipeline.models.runners import build_runner
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

COMPILED = {"step_transport": "compiled"}


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    runner = build_runner(load_config("configs/tiny.yaml", {"draft": "none"}))
    return {i: greedy_reference(runner, p, 60) for i, p in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def engines(ray_cluster):
    handles = {
        "tp1": start_engine(load_config("configs/tiny.yaml", {**COMPILED,
                                                              "speculation": "fixed"})),
        "tp2": start_engine(load_config("configs/tiny-tp2.yaml", {
            **COMPILED, "draft": "ngram", "max_num_batched_tokens": 24})),
    }
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
    client = EngineClient(engines["tp1"])

    async def main():
        got = []
        async for d in client.generate(EngineCall("ab", PROMPTS[0], SamplingParams(
                max_new_tokens=200, ignore_eos=True))):
            got.append(d)
            if len(got) == 2:
                await client.abort("ab")
        for _ in range(50):
            stats = await client.stats()
            if stats["free_slots"] == stats["num_slots"]:
                break
            await asyncio.sleep(0.1)
        return got, stats

    got, stats = asyncio.run(main())
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
