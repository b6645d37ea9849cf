"""Async client over the Engine actor handle: the only place the front end touches Ray.

Engine errors arrive wrapped in `ray.exceptions.RayTaskError`; the client unwraps them so callers
see `EngineOverloadedError`, `EngineDeadError` and `RequestTimeoutError` from pipeline.errors. An
actor that died (RayActorError) or an unreachable object becomes EngineDeadError.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pipeline.engine.relay import Demux
from pipeline.errors import EngineDeadError
from pipeline.frontend.background import fire_and_forget
from pipeline.output.request_output import RequestOutput
from pipeline.protocol.engine_call import EngineCall


def unwrap(exc: BaseException) -> BaseException:
    """The engine's own exception inside a Ray wrapper; Ray-level failures -> EngineDeadError."""
    import ray.exceptions as rex

    if isinstance(exc, rex.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return unwrap(cause)
        try:
            return exc.as_instanceof_cause()
        except Exception:  # noqa: BLE001 - an unusual wrapper: keep the original
            return exc
    if isinstance(exc, (rex.RayActorError, rex.ObjectLostError, rex.WorkerCrashedError)):
        return EngineDeadError(f"engine actor unavailable: {exc}")
    return exc


class EngineClient:
    """What the HTTP app needs from an engine; the same API as tests' fake engine.

    Every request of this client (per event loop) shares one stream of deltas from the engine
    (pipeline.engine.relay): a step's deltas for all of them cost one Ray message, not one per
    request. `generate` submits the request and reads its own queue of that stream."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._relay: Relay | None = None

    def _relay_here(self) -> Relay:
        loop = asyncio.get_running_loop()
        relay = self._relay
        if relay is None or relay.loop is not loop or relay.reader.done():
            relay = self._relay = Relay(self.handle, loop)
        return relay

    async def generate(self, call: EngineCall) -> AsyncIterator[RequestOutput]:
        """The request's deltas from the Engine actor, the first one empty as soon as the engine
        has queued it (a refusal raises instead); closing early aborts it there."""
        rid = call.rid
        relay = self._relay_here()
        queue = relay.demux.open(rid)
        finished = False
        try:
            try:
                await self.handle.submit.remote(call, relay.channel)
            except Exception as e:  # noqa: BLE001 - re-raised as the engine's own error
                finished = True  # refused: nothing to abort
                raise unwrap(e) from None
            yield RequestOutput(rid)  # queued: an empty first delta, so callers know
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # ended by the engine
                    raise item
                finished = item.finished
                yield item
        finally:
            relay.demux.close(rid)
            if not finished:
                # Closed early (client gone, timeout, error): free the request's slots.
                fire_and_forget(self.abort(rid))

    async def abort(self, rid: str) -> None:
        try:
            await self.handle.abort.remote(rid)
        except Exception as e:  # noqa: BLE001 - aborting a dead engine is not an error
            if not isinstance(unwrap(e), EngineDeadError):
                raise unwrap(e) from None

    async def stats(self) -> dict[str, Any]:
        return await self._call("stats")

    async def health(self) -> dict[str, Any]:
        return await self._call("health")

    async def model_info(self) -> dict[str, Any]:
        return await self._call("model_info")

    async def _call(self, method: str) -> Any:
        try:
            return await getattr(self.handle, method).remote()
        except Exception as e:  # noqa: BLE001
            raise unwrap(e) from None


class Relay:
    """One stream of an Engine actor's `outputs(channel)` into `demux` (its requests' queues),
    read by a task of the event loop it was made on. When the stream fails (the engine is gone)
    the requests in `rids` end with the error (None: every request of the demux)."""

    def __init__(self, handle: Any, loop: asyncio.AbstractEventLoop, channel: str | None = None,
                 demux: Demux | None = None, rids: set[str] | None = None) -> None:
        self.handle = handle
        self.loop = loop
        self.channel = channel or uuid.uuid4().hex
        self.demux = demux or Demux()
        self.rids = rids
        self.reader = loop.create_task(self._read())

    async def _read(self) -> None:
        stream = self.handle.outputs.remote(self.channel)
        try:
            async for ref in stream:
                self.demux.deliver(await ref)
            error: BaseException = EngineDeadError("the engine's output stream ended")
        except asyncio.CancelledError:
            # this loop is closing (asyncio.run ended): end the engine's side too, which
            # drops the channel and aborts what is left of its requests
            with contextlib.suppress(Exception):
                _cancel(stream)
            raise
        except Exception as e:  # noqa: BLE001 - the engine actor is gone
            error = unwrap(e)
        self.demux.fail(error, self.rids)


def _cancel(stream: Any) -> None:
    import ray

    if isinstance(stream, ray.ObjectRefGenerator):  # not a test's stand-in
        ray.cancel(stream)
