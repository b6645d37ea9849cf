"""A request as the client saw it (its deltas' arrival times), the closed loop that submits them,
and what the traces of a wave say: latencies and the busy window."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scripts.engine_bench.workloads import Request
from scripts.harness import percentile


@dataclass
class Trace:
    """One request as the client saw it."""

    rid: str
    submitted: float
    times: list[float]  # arrival of each delta that carried tokens
    counts: list[int]  # tokens per such delta
    token_ids: list[int]
    spec: tuple[int, int, int] | None = None  # final (verify_ct, accepted, draft tokens)


def busy_window(traces: list[Trace]) -> tuple[int, float]:
    """Tokens delivered while the client still had requests to submit, and that time: from the
    first submission to the last. In a closed loop the batch is full throughout it; after it the
    batch drains, and a drain measures how evenly requests end (a mode that finishes some
    requests sooner runs the rest at a smaller batch), not what a step of b requests yields. Every
    mode pays b prefills at the window's start and leaves b requests unfinished at its end."""
    if not traces:
        return 0, 0.0
    start, end = min(t.submitted for t in traces), max(t.submitted for t in traces)
    tokens = sum(c for t in traces for when, c in zip(t.times, t.counts) if when <= end)
    return tokens, end - start


def latency_stats(traces: list[Trace]) -> dict[str, float | None]:
    ttft = [(t.times[0] - t.submitted) * 1e3 for t in traces if t.times]
    gaps = [(b - a) * 1e3 for t in traces for a, b in zip(t.times, t.times[1:])]
    tpot = [(t.times[-1] - t.times[0]) * 1e3 / (len(t.token_ids) - 1)
            for t in traces if len(t.token_ids) > 1 and t.times]
    return {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "itl_p50_ms": percentile(gaps, 50), "itl_p99_ms": percentile(gaps, 99),
            "tpot_ms": sum(tpot) / len(tpot) if tpot else None}


async def stream_one(submit: Callable[[], Any], rid: str) -> Trace:
    """Submit through `submit()` (a stream or an awaitable of one) and time its deltas."""
    trace = Trace(rid, time.perf_counter(), [], [], [])
    stream = submit()
    if inspect.isawaitable(stream):
        stream = await stream
    async for d in stream:
        if d.token_ids:
            trace.times.append(time.perf_counter())
            trace.counts.append(len(d.token_ids))
            trace.token_ids += list(d.token_ids)
        if d.finished:
            trace.spec = (d.spec_verify_ct, d.spec_accepted_tokens, d.spec_draft_tokens)
    return trace


async def closed_loop(requests: list[Request], batch: int,
                      run: Callable[[Request], Any]) -> list[Trace]:
    """`run(r)` (a coroutine giving a Trace) for every request, at most `batch` at a time."""
    gate = asyncio.Semaphore(batch)

    async def one(r: Request) -> Trace:
        async with gate:
            return await run(r)

    return list(await asyncio.gather(*(one(r) for r in requests)))
