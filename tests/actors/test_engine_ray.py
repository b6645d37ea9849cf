"""The engine on Ray: TP=1 and TP=2 (two verifier actors) give target-only greedy output through
the streaming `generate` (TP=1 drafts with a draft model at fixed k, so drafts are verified
whatever the measured step costs; TP=2 drafts n-grams at adaptive k, its prompts chunked by a
small step budget); abort; a killed draft actor costs nothing (requests in flight complete with
target-only output, a new draft actor takes over and drafts again); a killed verifier rank or output
actor fails in-flight requests quickly, the engine reports unhealthy, then replaces only what
must be replaced (the verifier ranks, or the output actor) and keeps the other stages."""

from __future__ import annotations

import asyncio
import time

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
from support.reference_decode import greedy_reference

from actors.engine import stop_engine
from actors.engine_client import EngineClient
from pipeline.config import load_config
from pipeline.engine.stage_resources import live_stage_groups
from pipeline.errors import EngineDeadError
from pipeline.models.runners import build_runner
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    return greedy_references()


@pytest.fixture(scope="module")
def engines(ray_cluster):
    handles = start_tp_engines({})
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
    got, stats = abort_mid_stream(engines["tp1"])
    assert got[-1].finish_reason == "abort" and len(ids(got)) < 200
    assert stats["free_slots"] == stats["num_slots"] == 8


def test_a_cancelled_wait_call_ends_its_request(engines):
    """What Serve does to an engine replica's call when the HTTP client leaves: the request ends
    in the engine too, whether it was running or still queued."""
    import ray

    client = EngineClient(engines["tp1"])
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)  # each needs >= 40 steps
    slots = asyncio.run(client.stats())["num_slots"]
    engine = engines["tp1"]
    ray.get([engine.queue.remote(EngineCall(f"cancel-{i}", PROMPTS[0], long), "cancel-test")
             for i in range(slots + 1)])  # the last one waits for a slot
    runs = [engine.wait.remote(f"cancel-{i}") for i in range(slots + 1)]
    deadline = time.monotonic() + 30
    while (s := asyncio.run(client.stats()))["waiting"] != 1 or s["free_slots"] != 0:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    start = s["steps"]
    for ref in runs:
        ray.cancel(ref)
    deadline = time.monotonic() + 10
    while (s := asyncio.run(client.stats()))["free_slots"] != slots or s["waiting"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    assert s["steps"] - start < 20  # none ran to its end (the queued one would need 40 more)


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
        # Queued ones yield an empty delta at once.
        tasks = [asyncio.ensure_future(hold(f"o{i}")) for i in range(80)]
        for _ in range(300):
            if len(started) + len(refused) == 80:  # each queued (its empty delta) or refused
                break
            await asyncio.sleep(0.1)
        release.set()
        for t in tasks:
            t.cancel()  # the queued ones are still waiting for a slot: abort them too
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


LONG = SamplingParams(max_new_tokens=240, ignore_eos=True)


async def _kill_the_draft_under_load(handle) -> tuple[dict, float]:
    """Kill the draft actor under three long requests, then start another long one every 0.3 s
    until the new draft actor answers: the last ones run across the swap (its catch-up)."""
    import ray

    client = EngineClient(handle)
    draft = (await handle.stage_actors.remote())["draft"]
    first = asyncio.Event()

    async def consume(i: int) -> list:
        got = []
        async for d in client.generate(EngineCall(f"kd{i}", PROMPTS[i % len(PROMPTS)], LONG)):
            got.append(d)
            first.set()
        return got

    tasks = {i: asyncio.ensure_future(consume(i)) for i in range(3)}
    await first.wait()
    ray.kill(draft, no_restart=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        if (await client.stats())["draft_replacements"]:  # the new one answered
            break
        tasks[len(tasks)] = asyncio.ensure_future(consume(len(tasks)))
        await asyncio.sleep(0.3)
    results = await asyncio.gather(*tasks.values(), return_exceptions=True)
    return dict(zip(tasks, results)), time.monotonic() - t0


def test_killed_draft_actor_costs_nothing_and_a_new_one_drafts_again(engines):
    """The draft actor dies mid-generation: no request fails, outputs stay target-only (the
    steps verify without drafts), the engine stays healthy and is not rebuilt; the new draft
    actor takes over the requests running at the swap, and steps draft again."""
    import ray

    handle = engines["tp1"]
    runner = build_runner(load_config("configs/tiny.yaml", {"draft": "none"}))
    # the engine caps each output at max_model_len (256) less its prompt
    want = [greedy_reference(runner, p, min(LONG.max_new_tokens, 256 - len(p))) for p in PROMPTS]
    before = asyncio.run(EngineClient(handle).stats())
    results, elapsed = asyncio.run(_kill_the_draft_under_load(handle))
    for i, r in results.items():
        assert not isinstance(r, BaseException), r
        assert ids(r) == want[i % len(PROMPTS)] and r[-1].finish_reason == "length"
        assert sum(len(d.token_ids) for d in r) == 1 + r[-1].spec_verify_ct + \
            r[-1].spec_accepted_tokens
    stats = asyncio.run(EngineClient(handle).stats())
    assert stats["healthy"] and stats["restarts"] == before["restarts"] == 0
    assert stats["draft_live"] and stats["draft_losses"] == stats["draft_replacements"] == 1, \
        stats
    assert stats["draft_caught_up"] > 0, stats  # requests started before it, drafted by it
    print(f"{len(results)} requests; draft replaced after {stats['draft_downtime_s']:.2f}s; "
          f"all done {elapsed:.2f}s after the kill")
    # the new draft actor drafts (fixed k: every decode step asks for drafts)
    run_batch(handle, mixed_requests(8))
    after = asyncio.run(EngineClient(handle).stats())
    assert after["num_draft_tokens"] > stats["num_draft_tokens"] and after["restarts"] == 0
    assert ray.get(ray.get(handle.stage_actors.remote())["draft"].ping.remote())
    # idle: the health check's ping finds the dead draft actor and replaces it, no rebuild
    ray.kill(ray.get(handle.stage_actors.remote())["draft"], no_restart=True)
    deadline = time.monotonic() + 60
    while stats["draft_replacements"] < 2:
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
        stats = asyncio.run(EngineClient(handle).stats())  # its health() pings the stages
        assert stats["healthy"], stats
    assert stats["restarts"] == 0 and stats["draft_losses"] == 2


def _actor_ids(actors: dict) -> dict:
    return {"draft": actors["draft"]._actor_id, "output": actors["output"]._actor_id,
            "verifiers": [v._actor_id for v in actors["verifiers"]]}


@pytest.mark.parametrize(("tp", "which"), [("tp1", "verifier"), ("tp2", "verifier"),
                                           ("tp2", "output")])
def test_killed_stage_actor_fails_requests_fast_then_engine_replaces_only_it(engines, reference,
                                                                            tp, which):
    """A dead verifier rank or output actor ends the requests in flight with EngineDeadError;
    the rebuild keeps the stages that survived (every rank is replaced when one dies), they
    forget the failed requests (their ids serve again), and greedy output is target-only."""
    handle = engines[tp]
    restarts = asyncio.run(EngineClient(handle).stats())["restarts"]
    before = _actor_ids(ray_get(handle.stage_actors.remote()))
    groups = _stage_groups(handle)
    assert len(groups) == 1
    results, elapsed = asyncio.run(kill_during_generation(handle, which))
    t_kill = time.monotonic() - elapsed
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert elapsed < 10
    health = asyncio.run(EngineClient(handle).health())
    assert health["healthy"] is False and health["reason"]
    assert wait_healthy(handle)["healthy"]
    print(f"{tp} {which} kill: healthy again {time.monotonic() - t_kill:.2f}s after it")
    after = _actor_ids(ray_get(handle.stage_actors.remote()))
    assert after["draft"] == before["draft"]
    if which == "verifier":
        assert after["output"] == before["output"]
        assert not set(after["verifiers"]) & set(before["verifiers"])
    else:
        assert after["verifiers"] == before["verifiers"] and after["output"] != before["output"]
    # new ranks went into a new placement group, the old one is removed
    now = _stage_groups(handle)
    assert len(now) == 1 and (now == groups) == (which == "output"), (groups, now)
    # the failed requests' ids are free everywhere: the kept stages forgot them
    requests = [(f"k{which}{i}", PROMPTS[i], SamplingParams(max_new_tokens=20 + 5 * i))
                for i in range(3)]
    out = run_batch(handle, requests)
    for rid, prompt, params in requests:
        assert ids(out[rid]) == expected_cut(reference[PROMPTS.index(prompt)], params)[0], rid
    deadline = time.monotonic() + 10  # the last release plan runs a step after the finish
    while (stats := asyncio.run(EngineClient(handle).stats()))["free_slots"] < stats["num_slots"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats["restarts"] == restarts + 1 and stats["healthy"]


def test_a_killed_engines_groups_are_swept_and_a_live_engines_are_kept(engines, reference):
    """What a replica's health check does for an engine killed with its replica (no cleanup).
    Before: the engine without drafts sends steps ahead (async scheduling), output unchanged."""
    import ray

    from actors.engine import start_engine
    from actors.stage_groups import remove_orphan_stage_groups

    victim = start_engine(load_config("configs/tiny.yaml", {"draft": "none"}))
    requests = mixed_requests(8)
    out = run_batch(victim, requests)
    for rid, prompt, params in requests:
        want_ids, want_text = expected_cut(reference[PROMPTS.index(prompt)], params)
        assert ids(out[rid]) == want_ids and "".join(d.text for d in out[rid]) == want_text
        assert [d.finished for d in out[rid]].count(True) == 1
    stats = asyncio.run(EngineClient(victim).stats())
    assert stats["steps_ahead"] > stats["steps"] // 2, stats
    assert asyncio.run(EngineClient(victim).health())["healthy"]
    assert len(_stage_groups(victim)) == 1
    ray.kill(victim, no_restart=True)
    deadline = time.monotonic() + 30
    while _stage_groups(victim):
        remove_orphan_stage_groups()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert all(_stage_groups(engines[tp]) for tp in ("tp1", "tp2"))


def _stage_groups(handle) -> list[str]:
    import ray

    return live_stage_groups(ray.util.placement_group_table(), handle._actor_id.hex())


def ray_get(ref):
    import ray

    return ray.get(ref, timeout=30)


def test_generate_cli_prints_completions_finish_and_spec_stats(ray_cluster, capsys):
    from actors.generate import main

    assert main(["--config", "configs/tiny.yaml", "--max-tokens", "7", "--logprobs", "0",
                 "--set", "num_slots=2", "hello", "abc"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- finish_reason=length matched_stop=None tokens=7") == 2
    assert "--- logprobs=" in out and "tokens/s" in out and "tokens_per_verify=" in out
