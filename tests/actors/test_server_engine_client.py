"""EngineClient over a stand-in actor handle: Ray error unwrapping and abort on early close."""

from __future__ import annotations

import asyncio

import pytest
import ray.exceptions as rex

from actors.engine_client import EngineClient, unwrap
from pipeline.engine.relay import RelayMessage, encode_relay
from pipeline.errors import EngineDeadError, EngineOverloadedError
from pipeline.output.delta_codec import encode_deltas
from pipeline.output.request_output import RequestOutput
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall


def test_unwrap_gives_the_engine_error_and_maps_dead_actors():
    wrapped = rex.RayTaskError("generate", "traceback", EngineOverloadedError("queue full"))
    err = unwrap(wrapped)
    assert isinstance(err, EngineOverloadedError) and str(err) == "queue full"
    assert isinstance(unwrap(rex.RayActorError(error_msg="gone")), EngineDeadError)
    plain = ValueError("x")
    assert unwrap(plain) is plain


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class FakeHandle:
    """Mimics an Engine actor handle: `submit.remote(call, channel)` is awaitable (raising the
    refusal `error`), `outputs.remote(channel)` an async iterator of awaitable refs of relay
    messages: `outputs` one message each, for the submitted request."""

    def __init__(self, outputs, error=None):
        self.outputs_, self.error, self.aborted, self.calls = outputs, error, [], []
        self.submit = _Method(self._submit)
        self.outputs = _Method(self._outputs)
        self.abort = _Method(self._abort)
        self.health = _Method(self._dead)
        self._pending: list = []
        self._wake = asyncio.Event()

    async def _ref(self, value):
        if isinstance(value, BaseException):
            raise value
        return value

    async def _submit(self, call, channel):
        self.calls.append(call)
        if self.error is not None:
            raise self.error
        for out in self.outputs_:
            out.rid = call.rid
            self._pending.append(encode_relay(RelayMessage(encode_deltas([out]), [])))
        self._wake.set()

    async def _outputs(self, channel):
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                yield self._ref(self._pending.pop(0))

    def _abort(self, rid):
        self.aborted.append(rid)
        return self._ref(None)

    def _dead(self):
        return self._ref(rex.RayActorError(error_msg="actor died"))


def collect(client, rid="r1"):
    async def go():
        return [o async for o in client.generate(EngineCall(rid, [1, 2], SamplingParams()))]
    return asyncio.run(go())


def test_generate_yields_until_finished_without_aborting():
    handle = FakeHandle([RequestOutput("r1", [5], "a"),
                         RequestOutput("r1", [6], "b", finished=True, finish_reason="length")])
    outs = collect(EngineClient(handle))
    # first an empty delta: the engine has queued it
    assert [o.text for o in outs] == ["", "a", "b"] and handle.aborted == []


def test_overload_before_the_first_delta_raises_the_engine_error():
    handle = FakeHandle([], error=rex.RayTaskError("generate", "tb", EngineOverloadedError("full")))
    with pytest.raises(EngineOverloadedError):
        collect(EngineClient(handle))


def test_closing_early_aborts_the_request():
    handle = FakeHandle([RequestOutput("r1", [5], "a"), RequestOutput("r1", [6], "b")])
    client = EngineClient(handle)

    async def go():
        agen = client.generate(EngineCall("r9", [1], SamplingParams()))
        assert (await agen.__anext__()).token_ids == []  # queued
        first = await agen.__anext__()
        await agen.aclose()
        await asyncio.sleep(0)  # the abort is fire-and-forget
        await asyncio.sleep(0)
        return first

    assert asyncio.run(go()).text == "a"
    assert handle.aborted == ["r9"]


def test_dead_actor_on_health_is_engine_dead_error():
    with pytest.raises(EngineDeadError):
        asyncio.run(EngineClient(FakeHandle([])).health())


def test_generate_passes_the_admission_group_a_batchs_last_and_the_tenant_to_the_engine():
    handle = FakeHandle([RequestOutput("r1", [5], finished=True, finish_reason="length")])

    async def go(**kw):
        call = EngineCall("r1", [1], SamplingParams(), **kw)
        return [o async for o in EngineClient(handle).generate(call)]
    assert [o.token_ids for o in asyncio.run(go(group="http-7"))] == [[], [5]]
    asyncio.run(go(group="job", last=True, tenant="t" * 32, traceparent="tp"))
    assert [(c.group, c.last, c.tenant, c.traceparent) for c in handle.calls] == [
        ("http-7", False, "", None), ("job", True, "t" * 32, "tp")]
