"""Driving an engine actor (actors.engine) in the Ray engine tests: a batch of streamed requests,
killing a stage actor mid-generation, waiting for the engine to report healthy again."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from actors.engine_client import EngineClient
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall
from support.engine_cases import PROMPTS


async def collect(client: EngineClient, rid: str, prompt: list[int],
                  params: SamplingParams) -> list:
    return [d async for d in client.generate(EngineCall(rid, prompt, params))]


def run_batch(handle: Any, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """rid -> the deltas of each request, all streamed at once."""
    async def main():
        client = EngineClient(handle)
        return await asyncio.gather(*(collect(client, *r) for r in requests))

    return dict(zip([r[0] for r in requests], asyncio.run(main())))


async def kill_during_generation(handle: Any, which: str) -> tuple[list, float]:
    """Three long requests; once each has streamed a delta, kill one stage actor (`draft`,
    `output`, or the last verifier rank for `verifier`). Returns each request's deltas or error,
    and the seconds from the kill until every request ended."""
    import ray

    client = EngineClient(handle)
    actors = await handle.stage_actors.remote()
    victim = {"draft": actors["draft"], "verifier": actors["verifiers"][-1],
              "output": actors["output"]}[which]
    params = SamplingParams(max_new_tokens=240, ignore_eos=True)
    started = [asyncio.Event() for _ in range(3)]

    async def consume(i: int) -> list:
        got = []
        async for d in client.generate(EngineCall(f"k{which}{i}", PROMPTS[i], params)):
            got.append(d)
            started[i].set()
        return got

    tasks = [asyncio.ensure_future(consume(i)) for i in range(3)]
    for event in started:
        await event.wait()
    ray.kill(victim, no_restart=True)
    t0 = time.monotonic()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return results, time.monotonic() - t0


def wait_healthy(handle: Any, timeout: float = 90.0) -> dict:
    """The engine's health() once healthy, or the last answer after `timeout` seconds."""
    client = EngineClient(handle)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = asyncio.run(client.health())
        if health["healthy"]:
            return health
        time.sleep(0.5)
    return health


def abort_mid_stream(handle: Any) -> tuple[list, dict]:
    """A long request aborted after its second delta: its deltas, and the engine's stats once
    its slots are free again (or after 5 s)."""
    client = EngineClient(handle)

    async def main() -> tuple[list, dict]:
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

    return asyncio.run(main())


def greedy_references(max_tokens: int = 60) -> dict[int, list[int]]:
    """Target-only greedy outputs of every PROMPTS entry on the tiny model (independent code)."""
    from pipeline.config import load_config
    from pipeline.models.runners import build_runner
    from support.reference_decode import greedy_reference

    runner = build_runner(load_config("configs/tiny.yaml", {"draft": "none"}))
    return {i: greedy_reference(runner, p, max_tokens) for i, p in enumerate(PROMPTS)}


def start_tp_engines(overrides: dict[str, Any]) -> dict[str, Any]:
    """"tp1": the tiny pair, draft model at fixed k (adaptive k may rightly draft nothing on a
    slow machine: the tiny draft costs what the target does); "tp2": TP 2 with n-gram drafts and
    a small chunk budget (prompts prefilled in chunks both ranks take from the plan). Both with
    `overrides`."""
    from actors.engine import start_engine
    from pipeline.config import load_config

    return {
        "tp1": start_engine(load_config("configs/tiny.yaml",
                                        {**overrides, "speculation": "fixed"})),
        "tp2": start_engine(load_config("configs/tiny-tp2.yaml", {
            **overrides, "draft": "ngram", "max_num_batched_tokens": 24})),
    }
