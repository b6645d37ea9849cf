"""ReplicaClient (the ingress's engine client over the engine deployment) against stand-ins for
Serve's handle and the replicas' Engine actors: msgpack deltas decoded, the EngineCall carries
the request, early close cancels the call, engine errors keep their type, stats and health
cover every replica."""

from __future__ import annotations

import asyncio

import pytest
import ray.exceptions as rex

from actors.replica_client import ReplicaClient, engine_actor_name
from pipeline.engine.relay import RelayMessage, encode_relay
from pipeline.errors import EngineDeadError, EngineOverloadedError
from pipeline.output.delta_codec import encode_deltas
from pipeline.output.request_output import RequestOutput
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall

APP = "app"


class Response:
    """A stand-in DeploymentResponseGenerator of EngineReplica.generate(call, channel): the
    engine's name, then (the request running) the engine emits its deltas, then the end or the
    refusal `error`."""

    def __init__(self, engine, outputs, error=None):
        self.engine, self.outputs, self.error, self.cancelled = engine, outputs, error, False
        self._it = self._gen()

    def __aiter__(self):
        return self._it

    async def __anext__(self):
        return await self._it.__anext__()

    async def _gen(self):
        yield engine_actor_name(APP, "r0")
        self.engine.emit(self.outputs)
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class _Method:
    def __init__(self, fn):
        self.remote = fn


class Handle:
    def __init__(self, engine, outputs=(), error=None):
        self.engine = engine
        self.calls, self.channels, self.responses = [], [], []
        self.outputs, self.error = list(outputs), error
        self.generate = _Method(self._generate)
        self.model_info = _Method(self._info)

    def options(self, stream=False):
        return self

    def _generate(self, call, channel):
        self.calls.append(call)
        self.channels.append(channel)
        resp = Response(self.engine, self.outputs, self.error)
        self.responses.append(resp)
        return resp

    async def _info(self):
        return {"name": "tiny"}


class Engine:
    def __init__(self, stats=None, fail=None):
        self._stats, self.fail = stats, fail
        self.stats = _Method(lambda: self._answer(self._stats))
        self.health = _Method(lambda: self._answer({"healthy": True, "reason": ""}))
        self.outputs = _Method(self._outputs)
        self.abort = _Method(self._abort)
        self.streams, self.aborted, self._pending = [], [], []
        self._wake = asyncio.Event()

    async def _answer(self, value):
        if self.fail is not None:
            raise self.fail
        return value

    def emit(self, outputs):
        self._pending.extend(encode_relay(RelayMessage(encode_deltas([o]), []))
                             for o in outputs)
        self._wake.set()

    async def _outputs(self, channel):
        self.streams.append(channel)
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                yield self._answer(self._pending.pop(0))

    def _abort(self, rid):
        self.aborted.append(rid)
        return self._answer(None)


class Directory:
    prefix = engine_actor_name(APP, "")

    def __init__(self, engines):
        self.found = engines

    async def engines(self):
        await asyncio.sleep(0)  # the real lookup runs in a thread: other requests go on meanwhile
        return dict(self.found)


def client_over(outputs=(), error=None):
    engine = Engine()
    handle = Handle(engine, outputs, error)
    return ReplicaClient(handle, Directory({"r0": engine})), handle, engine


def run(coro):
    return asyncio.run(coro)


async def collect(client, **kw):
    return [o async for o in client.generate(EngineCall("r1", [1, 2, 3], SamplingParams(), **kw))]


def test_generate_sends_the_parsed_request_and_reads_its_deltas_from_the_engine():
    client, handle, engine = client_over([
        RequestOutput("r1", [5], "a"),
        RequestOutput("r1", [6], "b", finished=True, finish_reason="length")])
    outs = run(collect(client, traceparent="tp", group="g", tenant="t"))
    # first an empty delta: the engine has queued it
    assert [(o.token_ids, o.text) for o in outs] == [([], ""), ([5], "a"), ([6], "b")]
    call = handle.calls[0]
    assert (call.rid, call.prompt_ids, call.traceparent, call.group, call.tenant) == \
        ("r1", [1, 2, 3], "tp", "g", "t")
    assert handle.responses[0].cancelled is False and engine.aborted == []
    assert engine.streams == handle.channels  # the engine streams the ingress's channel


def test_requests_of_one_ingress_share_one_stream_per_engine():
    client, handle, engine = client_over()

    async def go():
        for i in range(3):
            handle.outputs = [RequestOutput(f"q{i}", [i], finished=True, finish_reason="length")]
            outs = [o async for o in client.generate(EngineCall(f"q{i}", [1], SamplingParams()))]
            assert [o.token_ids for o in outs] == [[], [i]]

    run(go())
    assert len(engine.streams) == 1 and len(set(handle.channels)) == 1


def test_concurrent_first_requests_share_one_stream_per_engine():
    """Two streams of one channel would split its messages between them, and a request's deltas
    could then arrive out of order."""
    client, handle, engine = client_over()
    handle.outputs = []

    async def go():
        calls = [EngineCall(f"c{i}", [1], SamplingParams()) for i in range(4)]
        agens = [client.generate(c) for c in calls]
        firsts = await asyncio.gather(*(a.__anext__() for a in agens))  # queued, all at once
        for a in agens:
            await a.aclose()
        return firsts

    assert [o.token_ids for o in run(go())] == [[]] * 4
    assert len(engine.streams) == 1, engine.streams


def test_closing_early_aborts_in_the_engine_and_cancels_the_replica_call():
    client, handle, engine = client_over([RequestOutput("r1", [5], "a"),
                                          RequestOutput("r1", [6], "b")])

    async def go():
        agen = client.generate(EngineCall("r1", [1], SamplingParams()))
        await agen.__anext__()
        await agen.aclose()
        for _ in range(3):  # the abort is fire-and-forget
            await asyncio.sleep(0)

    run(go())
    assert handle.responses[0].cancelled is True and engine.aborted == ["r1"]


def test_abort_cancels_the_running_call_of_that_request():
    client, handle, _ = client_over([RequestOutput("r7", [5], "a"),
                                     RequestOutput("r7", [6], "b")])

    async def go():
        agen = client.generate(EngineCall("r7", [1], SamplingParams()))
        await agen.__anext__()
        await client.abort("r7")
        await client.abort("unknown")  # nothing to cancel: no error
        return handle.responses[0].cancelled

    assert run(go()) is True


def test_engine_errors_keep_their_type_through_the_replica():
    wrapped = rex.RayTaskError("generate", "tb", EngineOverloadedError("queue full"))
    with pytest.raises(EngineOverloadedError, match="queue full"):
        run(collect(client_over(error=wrapped)[0]))
    with pytest.raises(EngineDeadError):
        run(collect(client_over(error=rex.RayActorError(error_msg="gone"))[0]))


def test_stats_cover_every_replica_and_one_that_fails_keeps_its_counters_unhealthy():
    r2 = Engine({"steps": 4, "healthy": True})
    client = ReplicaClient(Handle(None), Directory({"a": Engine({"steps": 3, "healthy": True}),
                                                "b": r2}))
    first = run(client.stats())
    assert first["steps"] == 7 and set(first["replicas"]) == {"a", "b"}
    r2.fail = rex.RayActorError(error_msg="gone")
    second = run(client.stats())
    assert second["steps"] == 7 and second["healthy"] is True
    assert second["replicas"]["b"] == {"steps": 4, "healthy": False}


def test_health_holds_while_one_replica_serves_and_fails_with_none():
    dead = Engine(fail=rex.RayActorError(error_msg="gone"))
    client = ReplicaClient(Handle(None), Directory({"a": Engine(), "b": dead}))
    health = run(client.health())
    assert health["healthy"] is True and "replica b" in health["reason"]
    assert run(ReplicaClient(Handle(None), Directory({"b": dead})).health())["healthy"] is False
    assert run(ReplicaClient(Handle(None), Directory({})).health())["healthy"] is False
    with pytest.raises(EngineDeadError):
        run(ReplicaClient(Handle(None), Directory({})).stats())


def test_engine_actor_names_are_per_app_and_replica():
    assert engine_actor_name("app", "x1") == "specrelay-engine:app:x1"
