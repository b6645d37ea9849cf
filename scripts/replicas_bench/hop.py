"""What the ingress -> replica hop adds: TTFT straight to the replica's Engine actor against
through the engine deployment's Serve handle, a plain call both ways, and HTTP TTFT for context."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import httpx

from scripts.harness import percentile


async def hop_ttft(app: str, prompts: list[list[int]], max_tokens: int,
                   ) -> list[tuple[float, float]]:
    """(direct-to-engine TTFT, through-the-Serve-handle TTFT) per prompt, alternating which goes
    first; both to the app's one replica."""
    from ray import serve

    from actors.engine_client import EngineClient
    from actors.replica_client import EngineDirectory
    from pipeline.params import SamplingParams
    from pipeline.protocol.engine_call import EngineCall

    (engine,) = (await EngineDirectory(app).engines()).values()
    direct = EngineClient(engine)
    handle = serve.get_deployment_handle("EngineReplica", app_name=app).options(stream=True)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def via_engine(ids: list[int]) -> float:
        t0 = time.perf_counter()
        first = None
        async for _ in direct.generate(EngineCall(f"hop-e-{uuid.uuid4().hex}", ids, params)):
            first = first or time.perf_counter() - t0
        return first

    async def via_handle(ids: list[int]) -> float:
        t0 = time.perf_counter()
        first = None
        async for _ in handle.generate.remote(EngineCall(f"hop-h-{uuid.uuid4().hex}", ids,
                                                         params)):
            first = first or time.perf_counter() - t0
        return first

    pairs = []
    for i, ids in enumerate(prompts):
        if i % 2:
            h = await via_handle(ids)
            e = await via_engine(ids[::-1])  # another prompt: no prefix-cache advantage
        else:
            e = await via_engine(ids)
            h = await via_handle(ids[::-1])
        pairs.append((e, h))
    return pairs


async def hop_call(app: str, calls: int) -> list[tuple[float, float]]:
    """(engine.health() direct, the same through the replica) round trips, alternating: the
    hop's cost without the engine's own time-to-first-token variance in it."""
    from ray import serve

    from actors.replica_client import EngineDirectory

    (engine,) = (await EngineDirectory(app).engines()).values()
    handle = serve.get_deployment_handle("EngineReplica", app_name=app)
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await engine.health.remote()
        t1 = time.perf_counter()
        await handle.health.remote()
        out.append((t1 - t0, time.perf_counter() - t1))
    return out


async def http_ttft(url: str, model: str, prompts: list[list[int]], max_tokens: int,
                    ) -> list[float]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for ids in prompts:
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            t0 = time.perf_counter()
            first = None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {") and any(
                            c.get("text") for c in json.loads(line[6:]).get("choices") or []):
                        first = time.perf_counter() - t0
            out.append(first)
    return out


def measure_hop(app: str, url: str, model: str, prompts: list[list[int]],
                http_prompts: list[list[int]], calls: int) -> dict[str, Any]:
    """p50 / p99 ms of each TTFT, of the paired difference, of a call through the hop, and the
    shift of the TTFT distribution the hop makes."""
    import ray

    pairs = asyncio.run(hop_ttft(app, prompts, 8))
    direct = [e * 1e3 for e, _ in pairs]
    handle = [h * 1e3 for _, h in pairs]
    diff = [h - e for e, h in zip(direct, handle)]
    http = [t * 1e3 for t in asyncio.run(http_ttft(url, model, http_prompts, 8))]
    rpc = [(h - e) * 1e3 for e, h in asyncio.run(hop_call(app, calls))]
    hop: dict[str, Any] = {
        name: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99)}
        for name, v in (("engine_ttft", direct), ("handle_ttft", handle), ("hop_added", diff),
                        ("http_ttft", http), ("hop_call_added", rpc))}
    hop["ttft_shift"] = {q: hop["handle_ttft"][q] - hop["engine_ttft"][q]
                         for q in ("p50_ms", "p99_ms")}
    hop["ray"] = ray.__version__
    return hop
