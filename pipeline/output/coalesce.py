"""Coalescing a stream for a hop that costs per message (the engine replica's relay): an idle
consumer gets each item at once, a busy one what arrived meanwhile in one list."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def coalesce(source: AsyncIterator[T]) -> AsyncIterator[list[T]]:
    """An error of `source` is raised after the items before it. Closing the consumer cancels
    the reading of `source`, so its own clean-up (an engine abort) runs."""
    pending: list[T] = []
    arrived = asyncio.Event()
    ended = False
    error: BaseException | None = None

    async def pump() -> None:
        nonlocal ended, error
        try:
            async for item in source:
                pending.append(item)
                arrived.set()
        # A cancellation from inside the source too: the consumer must not take it for an end.
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001
            error = e
        finally:
            ended = True
            arrived.set()

    reader = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            await arrived.wait()
            arrived.clear()  # before taking, so what arrives from here on sets it again
            if pending:
                batch = pending[:]
                pending.clear()
                yield batch
            if ended and not pending:
                if error is not None:
                    raise error
                return
    finally:
        reader.cancel()
