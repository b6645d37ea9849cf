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
