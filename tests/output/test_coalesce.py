"""coalesce: a relay's batches keep every item in order, add nothing for an idle consumer, merge
what a busy one missed, and pass errors and early exits through."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.output.coalesce import coalesce


async def ticks(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def source(items: list[int], gaps: list[int], log: list[str] | None = None):
    try:
        for item, gap in zip(items, gaps):
            await ticks(gap)
            yield item
    finally:
        if log is not None:
            log.append("source closed")


async def drain(stream, pauses: list[int]) -> list[list[int]]:
    got = []
    i = 0
    async for batch in stream:
        got.append(batch)
        await ticks(pauses[i % len(pauses)] if pauses else 0)
        i += 1
    return got


@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 5), max_size=8))
@settings(max_examples=200, deadline=None)
def test_every_item_once_in_order_whatever_the_timing(gaps, pauses):
    items = list(range(len(gaps)))
    got = asyncio.run(drain(coalesce(source(items, gaps)), pauses))
    assert [x for batch in got for x in batch] == items
    assert all(got)  # no empty batch


def test_an_idle_consumer_gets_each_item_alone():
    items = list(range(10))
    got = asyncio.run(drain(coalesce(source(items, [3] * 10)), [0]))
    assert got == [[i] for i in items]


def test_a_busy_consumer_gets_what_arrived_meanwhile_in_one_batch():
    items = list(range(12))
    got = asyncio.run(drain(coalesce(source(items, [1] * 12)), [20]))
    assert got[0] == [0] and len(got) < 4
    assert [x for b in got for x in b] == items


def test_an_error_comes_after_the_items_before_it():
    async def failing():
        yield 1
        yield 2
        raise ValueError("engine failed")

    async def run():
        got = []
        with pytest.raises(ValueError, match="engine failed"):
            async for batch in coalesce(failing()):
                got.extend(batch)
        return got

    assert asyncio.run(run()) == [1, 2]


def test_a_cancellation_inside_the_source_is_not_a_clean_end():
    async def cancelled():
        yield 1
        raise asyncio.CancelledError

    async def run():
        got = []
        with pytest.raises(asyncio.CancelledError):
            async for batch in coalesce(cancelled()):
                got.extend(batch)
        return got

    assert asyncio.run(run()) == [1]


def test_leaving_early_closes_the_source():
    log: list[str] = []

    async def forever():
        try:
            i = 0
            while True:
                await ticks(1)
                yield i
                i += 1
        finally:
            log.append("source closed")

    async def run():
        stream = coalesce(forever())
        async for batch in stream:
            if batch[-1] >= 3:
                break
        await stream.aclose()
        await ticks(3)  # the reader's cancellation runs on the loop

    asyncio.run(run())
    assert log == ["source closed"]


def test_cancelling_the_consumer_closes_the_source():
    log: list[str] = []

    async def run():
        async def consume():
            async for _ in coalesce(source(list(range(1000)), [5] * 1000, log)):
                pass

        task = asyncio.get_running_loop().create_task(consume())
        await ticks(20)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await ticks(3)

    asyncio.run(run())
    assert log == ["source closed"]
