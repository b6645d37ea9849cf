"""ReplicaClient (the ingress's engine client over the engine deployment) against stand-ins for
Serve's handle and the replicas' Engine actors: msgpack deltas decoded, the EngineCall carries
the request, early close cancels the call, engine errors keep their type, stats and health
cover every replica."""

from __future__ import annotations

import asyncio

import pytest
import ray.exceptions as rex

from actors.replica_client import ReplicaClient, engine_actor_name
from pipeline.errors import EngineDeadError, EngineOverloadedError
from pipeline.output.delta_codec import encode_deltas
from pipeline.output.request_output import RequestOutput
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall


class Response:
    """A stand-in DeploymentResponseGenerator."""

    def __init__(self, payloads, error=None):
        self.payloads, self.error, self.cancelled = payloads, error, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for p in self.payloads:
            yield p
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class _Method:
    def __init__(self, fn):
        self.remote = fn


class Handle:
    def __init__(self, outputs=(), error=None):
        self.calls, self.responses = [], []
        self.outputs, self.error = list(outputs), error
        self.generate = _Method(self._generate)
        self.model_info = _Method(self._info)

    def options(self, stream=False):
        return self

    def _generate(self, call):
        self.calls.append(call)
        resp = Response([encode_deltas([o]) for o in self.outputs], self.error)
        self.responses.append(resp)
        return resp

    async def _info(self):
        return {"name": "tiny"}


class Engine:
    def __init__(self, stats=None, fail=None):
        self._stats, self.fail = stats, fail
        self.stats = _Method(lambda: self._answer(self._stats))
        self.health = _Method(lambda: self._answer({"healthy": True, "reason": ""}))

    async def _answer(self, value):
        if self.fail is not None:
            raise self.fail
        return value


class Directory:
    def __init__(self, engines):
        self.found = engines

    async def engines(self):
        return dict(self.found)


def run(coro):
    return asyncio.run(coro)


async def collect(client, **kw):
    return [o async for o in client.generate(EngineCall("r1", [1, 2, 3], SamplingParams(), **kw))]


def test_generate_sends_the_parsed_request_and_decodes_the_replicas_deltas():
    handle = Handle([RequestOutput("r1", [5], "a"),
                     RequestOutput("r1", [6], "b", finished=True, finish_reason="length")])
    client = ReplicaClient(handle, Directory({}))
    outs = run(collect(client, traceparent="tp", group="g", tenant="t"))
    assert [(o.token_ids, o.text) for o in outs] == [([5], "a"), ([6], "b")]
    call = handle.calls[0]
    assert (call.rid, call.prompt_ids, call.traceparent, call.group, call.tenant) == \
        ("r1", [1, 2, 3], "tp", "g", "t")
    assert handle.responses[0].cancelled is False


def test_closing_early_cancels_the_replica_call():
    handle = Handle([RequestOutput("r1", [5], "a"), RequestOutput("r1", [6], "b")])
    client = ReplicaClient(handle, Directory({}))

    async def go():
        agen = client.generate(EngineCall("r1", [1], SamplingParams()))
        await agen.__anext__()
        await agen.aclose()

    run(go())
    assert handle.responses[0].cancelled is True


def test_abort_cancels_the_running_call_of_that_request():
    handle = Handle([RequestOutput("r1", [5], "a"), RequestOutput("r1", [6], "b")])
    client = ReplicaClient(handle, Directory({}))

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
        run(collect(ReplicaClient(Handle([], error=wrapped), Directory({}))))
    with pytest.raises(EngineDeadError):
        run(collect(ReplicaClient(Handle([], error=rex.RayActorError(error_msg="gone")),
                                  Directory({}))))


def test_stats_cover_every_replica_and_one_that_fails_keeps_its_counters_unhealthy():
    r2 = Engine({"steps": 4, "healthy": True})
    client = ReplicaClient(Handle(), Directory({"a": Engine({"steps": 3, "healthy": True}),
                                                "b": r2}))
    first = run(client.stats())
    assert first["steps"] == 7 and set(first["replicas"]) == {"a", "b"}
    r2.fail = rex.RayActorError(error_msg="gone")
    second = run(client.stats())
    assert second["steps"] == 7 and second["healthy"] is True
    assert second["replicas"]["b"] == {"steps": 4, "healthy": False}


def test_health_holds_while_one_replica_serves_and_fails_with_none():
    dead = Engine(fail=rex.RayActorError(error_msg="gone"))
    client = ReplicaClient(Handle(), Directory({"a": Engine(), "b": dead}))
    health = run(client.health())
    assert health["healthy"] is True and "replica b" in health["reason"]
    assert run(ReplicaClient(Handle(), Directory({"b": dead})).health())["healthy"] is False
    assert run(ReplicaClient(Handle(), Directory({})).health())["healthy"] is False
    with pytest.raises(EngineDeadError):
        run(ReplicaClient(Handle(), Directory({})).stats())


def test_engine_actor_names_are_per_app_and_replica():
    assert engine_actor_name("app", "x1") == "specrelay-engine:app:x1"
