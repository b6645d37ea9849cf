"""The relay of deltas from an engine to one client (an engine replica, a batch job, a benchmark):
every request of that client shares one stream, so a step's deltas cost the hop about one
message, whatever the batch.

Engine side, `OutputChannel` gathers the deltas (and error ends) of the client's requests as
the step loop delivers them; `batches()` hands over everything that arrived while the last
message was on its way, as one `RelayMessage` in msgpack: the deltas as one
pipeline.output.delta_codec message, then the requests that ended with an error. Client side, `Demux` routes a message's
items to each request's queue, in order. A request's error always comes after its deltas (a
request ends at its error: nothing of it follows).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, NamedTuple

from pipeline.errors import EngineDeadError
from pipeline.output.delta_codec import decode_deltas, encode_deltas
from pipeline.output.request_output import RequestOutput
from pipeline.protocol.wire import Codec, Field, Kind, ProtocolError

RELAY_VERSION = 1

class RelayMessage(NamedTuple):
    deltas: bytes  # pipeline.output.delta_codec
    errors: list[tuple[str, str]]  # (rid, EngineDeadError's message): the engine's only error


def _load_deltas(raw: Any, name: str, got: dict[str, Any]) -> bytes:
    if type(raw) is not bytes:
        raise ProtocolError(f"{name} must be bytes")
    return raw


def _load_errors(raw: Any, name: str, got: dict[str, Any]) -> list[tuple[str, str]]:
    if type(raw) is not list or not all(
            type(e) is list and len(e) == 2 and all(type(x) is str for x in e) for e in raw):
        raise ProtocolError(f"{name} must be a list of [request id, reason] pairs")
    return [(rid, why) for rid, why in raw]


RELAY = Codec(RelayMessage, {"m": "relay", "v": RELAY_VERSION}, [
    Field("deltas", "deltas", Kind(None, _load_deltas)),
    Field("errors", "errors", Kind(lambda v, attr: [list(e) for e in v], _load_errors)),
])
encode_relay = RELAY.encode
decode_relay = RELAY.decode  # ProtocolError, naming the field, for anything malformed


class OutputChannel:
    """The deltas and error ends of one client's requests, waiting for the relay."""

    def __init__(self) -> None:
        self.open: set[str] = set()  # requests not yet finished or failed
        self._deltas: list[RequestOutput] = []
        self._errors: list[tuple[str, str]] = []
        self._arrived = asyncio.Event()

    def add(self, rid: str) -> None:
        self.open.add(rid)

    def put(self, rid: str, item: RequestOutput | BaseException) -> None:
        """A request's next delta, or the error that ends it (an EngineDeadError)."""
        if isinstance(item, BaseException):
            self._errors.append((rid, str(item)))
            self.open.discard(rid)
        else:
            self._deltas.append(item)
            if item.finished:
                self.open.discard(rid)
        self._arrived.set()

    def take(self) -> bytes | None:
        """Everything that arrived since the last take, as one encoded RelayMessage (None:
        nothing)."""
        self._arrived.clear()
        if not self._deltas and not self._errors:
            return None
        deltas, errors = self._deltas, self._errors
        self._deltas, self._errors = [], []
        return encode_relay(RelayMessage(encode_deltas(deltas), errors))

    async def batches(self) -> AsyncIterator[bytes]:
        """What arrived since the last message, one message at a time, forever."""
        while True:
            await self._arrived.wait()
            message = self.take()
            if message is not None:
                yield message


def request_sink(channel: OutputChannel, span: Any, ended: asyncio.Future | None = None
                 ) -> Callable[[str, RequestOutput | BaseException], None]:
    """A request's sink (EngineCore.add_request): its items go to `channel`; its engine span
    (`spec.engine.request`) gets the cached-token count of the first delta and ends with the
    request, and so does `ended`."""
    def sink(rid: str, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput) and item.cached_tokens is not None:
            span.set_attribute("request.cached_tokens", item.cached_tokens)
        channel.put(rid, item)
        if isinstance(item, BaseException) or item.finished:
            span.end()
            if ended is not None and not ended.done():
                ended.set_result(None)

    return sink


class Demux:
    """Client side: each open request's deltas, in order, in a queue of its own."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}

    def open(self, rid: str) -> asyncio.Queue[RequestOutput | BaseException]:
        """Before the request is submitted: its first deltas may come before the answer."""
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = queue
        return queue

    def close(self, rid: str) -> None:
        self._queues.pop(rid, None)

    def deliver(self, payload: bytes) -> None:
        """Route an encoded RelayMessage; items of requests no longer open (closed early) are
        dropped. ProtocolError for a malformed message (nothing of it is delivered)."""
        deltas, errors = decode_relay(payload)
        for delta in decode_deltas(deltas):
            queue = self._queues.get(delta.rid)
            if queue is not None:
                queue.put_nowait(delta)
        for rid, reason in errors:
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(EngineDeadError(reason))

    def fail(self, exc: BaseException, rids: Iterable[str] | None = None) -> None:
        """A stream itself failed (its engine is gone): its open requests (`rids`; None: every
        open one) end with `exc`."""
        for rid in list(self._queues) if rids is None else list(rids):
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(exc)
