"""Coalescing a stream of deltas for a hop that costs per message (the engine replica's relay).

Each message through a Ray Serve streaming call costs both ends about the same whatever it
carries, so a relay that sends one message per engine step spends its CPU on messages, not
tokens. `coalesce` keeps reading its source while the consumer is busy and hands over everything
that arrived since in one list: an idle consumer gets each item alone and at once (no added
latency); a busy one gets fewer, larger lists. Order is kept; nothing is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def coalesce(source: AsyncIterator[T]) -> AsyncIterator[list[T]]:
    """`source`'s items in order, in lists of what arrived while the consumer was away.

    An error of `source` is raised after the items that came before it. Closing or cancelling
    the consumer cancels the reading of `source` (so its own clean-up, e.g. an engine abort, runs).
    """
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
        # handed to the consumer after the items before it; a cancellation from inside the
        # source too (the consumer must not take it for a clean end)
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001
            error = e
        finally:
            ended = True
            arrived.set()

    reader = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            await arrived.wait()
            arrived.clear()  # before taking: what arrives from here on sets it again
            if pending:
                batch = pending[:]
                pending.clear()
                yield batch
            if ended and not pending:
                if error is not None:
                    raise error
                return
    finally:
        reader.cancel()  # the consumer left early: stop reading (the source cleans up)
