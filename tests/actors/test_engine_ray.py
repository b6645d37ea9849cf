"""The engine on Ray over plain actor calls (`step_transport: calls`, the default; the compiled
transport has the same tests in test_engine_ray_compiled.py): TP=1 and TP=2 (two verifier
actors) give target-only greedy output through the streaming `generate` (TP=1 drafts with a draft
model at fixed k, so drafts are verified whatever the measured step costs; TP=2 drafts n-grams at
adaptive k, its prompts chunked by a small step budget); abort; a killed draft actor or verifier
rank fails in-flight requests quickly, the engine reports unhealthy, then rebuilds its stage
actors."""

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

CALLS = {"step_transport": "calls"}


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    runner = build_runner(load_config("configs/tiny.yaml", {"draft": "none"}))
    return {i: greedy_reference(runner, p, 60) for i, p in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def engines(ray_cluster):
    handles = {
        # Adaptive k may rightly draft nothing here: the tiny draft model costs what the target
        # does, and on a slow machine no draft pays at batch 8.
        "tp1": start_engine(load_config("configs/tiny.yaml", {**CALLS, "speculation": "fixed"})),
        # TP=2 with a small chunk budget: prompts over it are prefilled in chunks that both
        # ranks take from the plan
        "tp2": start_engine(load_config("configs/tiny-tp2.yaml", {**CALLS, "draft": "ngram",
                                                                  "max_num_batched_tokens": 24})),
    }
    yield handles
    for h in handles.values():
        stop_engine(h)


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
def test_ray_engine_greedy_equals_target_only(engines, reference, tp):
    requests = mixed_requests(8)
    out = run_batch(engines[tp], requests)
    for rid, prompt, params in requests:
        want_ids, want_text = expected_cut(reference[PROMPTS.index(prompt)], params)
        deltas = out[rid]
        assert ids(deltas) == want_ids
        assert "".join(d.text for d in deltas) == want_text
        assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    stats = asyncio.run(EngineClient(engines[tp]).stats())
    assert stats["num_draft_tokens"] > 0 and stats["healthy"]
    info = asyncio.run(EngineClient(engines[tp]).model_info())
    assert info["vocab_size"] == 256 and info["eos_token_ids"] == [2]
    assert info["tensor_parallel_size"] == (2 if tp == "tp2" else 1)


def test_ray_abort_ends_stream_and_frees_slots(engines):
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
    assert stats["free_slots"] == stats["num_slots"] == 8


def test_ray_full_queue_raises_overloaded_and_aborts_free_everything(engines):
    from pipeline.errors import EngineOverloadedError

    client = EngineClient(engines["tp1"])
    params = SamplingParams(max_new_tokens=250, ignore_eos=True)

    async def main():
        release = asyncio.Event()
        started, refused = [], []

        async def hold(rid: str) -> None:
            gen = client.generate(EngineCall(rid, PROMPTS[1], params))
            try:
                started.append(await gen.__anext__())
                await release.wait()
            except EngineOverloadedError as e:
                refused.append(e)
            finally:
                await gen.aclose()  # closing early aborts the request

        # 64 wait, and the 8 slots take what the engine admitted before the queue filled (0-8,
        # depending on how fast it steps); the rest are refused before they yield anything.
        tasks = [asyncio.ensure_future(hold(f"o{i}")) for i in range(80)]
        for _ in range(300):
            if len(started) + len(refused) >= 16:
                break
            await asyncio.sleep(0.1)
        release.set()
        for t in tasks:
            t.cancel()  # the queued ones are still waiting for a first delta: abort them too
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(300):
            stats = await client.stats()
            if stats["free_slots"] == 8 and stats["waiting"] == 0 and stats["running"] == 0:
                break
            await asyncio.sleep(0.1)
        return refused, stats

    refused, stats = asyncio.run(main())
    assert 80 - 64 - 8 <= len(refused) <= 80 - 64 and "full" in str(refused[0])
    assert stats["free_slots"] == 8 and stats["waiting"] == 0 and stats["healthy"]


@pytest.mark.parametrize(("tp", "which"), [("tp1", "draft"), ("tp2", "verifier")])
def test_killed_stage_actor_fails_requests_fast_then_engine_rebuilds(engines, tp, which):
    handle = engines[tp]
    results, elapsed = asyncio.run(kill_during_generation(handle, which))
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert elapsed < 10
    health = asyncio.run(EngineClient(handle).health())
    assert health["healthy"] is False and health["reason"]
    # The engine replaces its stage actors and serves again.
    assert wait_healthy(handle)["healthy"]
    out = run_batch(handle, [("after", PROMPTS[1], SamplingParams(max_new_tokens=5))])
    assert len(ids(out["after"])) == 5
    assert asyncio.run(EngineClient(handle).stats())["restarts"] == 1


def test_generate_cli_prints_completions_finish_and_spec_stats(ray_cluster, capsys):
    from actors.generate import main

    assert main(["--config", "configs/tiny.yaml", "--max-tokens", "7", "--logprobs", "0",
                 "--set", "num_slots=2", "hello", "abc"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- finish_reason=length matched_stop=None tokens=7") == 2
    assert "--- logprobs=" in out and "tokens/s" in out and "tokens_per_verify=" in out
