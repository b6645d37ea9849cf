"""The engine -> client relay (pipeline.engine.relay): one message carries every delta that arrived
since the last one, each request's deltas come out in order and its error after them."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.engine.relay import (
    Demux,
    OutputChannel,
    RelayMessage,
    decode_relay,
    encode_relay,
)
from pipeline.errors import EngineDeadError
from pipeline.output.delta_codec import decode_deltas, encode_deltas
from pipeline.output.request_output import RequestOutput
from pipeline.protocol.wire import ProtocolError, pack


async def _drain(channel: OutputChannel, demux: Demux, messages: list) -> None:
    message = channel.take()
    if message is not None:
        messages.append(message)
        demux.deliver(message)
    assert channel.take() is None  # one take holds everything that arrived


def test_batches_waits_for_what_arrives_and_hands_it_over_at_once():
    async def go():
        channel = OutputChannel()
        gen = channel.batches()
        waiting = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        assert not waiting.done()
        channel.put("a", RequestOutput("a", [1], "x"))
        channel.put("a", RequestOutput("a", [2], "y"))
        return await asyncio.wait_for(waiting, 5)

    message = decode_relay(asyncio.run(go()))
    assert message.errors == [] and [d.token_ids for d in decode_deltas(message.deltas)] == \
        [[1], [2]]


def test_a_steps_deltas_for_many_requests_are_one_message():
    async def go():
        channel, demux = OutputChannel(), Demux()
        queues = {f"r{i}": demux.open(f"r{i}") for i in range(32)}
        for rid in queues:
            channel.add(rid)
        for rid in queues:
            channel.put(rid, RequestOutput(rid, [7], "x"))
        messages: list = []
        await _drain(channel, demux, messages)
        return messages, {rid: q.get_nowait().token_ids for rid, q in queues.items()}, channel

    messages, got, channel = asyncio.run(go())
    assert len(messages) == 1 and got == {f"r{i}": [7] for i in range(32)}
    assert channel.open == {f"r{i}" for i in range(32)}  # none finished


def test_an_error_ends_its_request_after_its_deltas_and_closed_requests_are_dropped():
    async def go():
        channel, demux = OutputChannel(), Demux()
        a, b = demux.open("a"), demux.open("b")
        demux.open("gone")
        for rid in ("a", "b", "gone"):
            channel.add(rid)
        channel.put("a", RequestOutput("a", [1], "p"))
        channel.put("a", EngineDeadError("verifier died"))
        channel.put("b", RequestOutput("b", [2], "q", finished=True, finish_reason="length"))
        channel.put("gone", RequestOutput("gone", [3], "r"))
        demux.close("gone")
        await _drain(channel, demux, [])
        return [a.get_nowait(), a.get_nowait()], b.get_nowait(), channel.open

    (first, err), done, still_open = asyncio.run(go())
    assert first.token_ids == [1] and isinstance(err, EngineDeadError)
    assert str(err) == "verifier died" and done.finished
    assert still_open == {"gone"}


def test_fail_ends_the_open_requests_of_the_failed_stream_only():
    async def go():
        demux = Demux()
        qs = {r: demux.open(r) for r in ("a", "b", "c")}
        demux.fail(EngineDeadError("engine actor unavailable"), ["a", "b", "closed"])
        first = {r: q.qsize() for r, q in qs.items()}
        demux.fail(EngineDeadError("all"))
        return first, {r: q.qsize() for r, q in qs.items()}

    first, then = asyncio.run(go())
    assert first == {"a": 1, "b": 1, "c": 0} and then == {"a": 2, "b": 2, "c": 1}


def test_a_request_id_open_twice_is_refused():
    demux = Demux()
    demux.open("a")
    try:
        demux.open("a")
    except ValueError as e:
        assert "'a'" in str(e)
    else:
        raise AssertionError("the second open was accepted")


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), max_size=40))
def test_each_requests_deltas_arrive_in_order_however_messages_are_cut(puts):
    """Puts interleaved with partial drains: every request sees exactly its own sequence."""
    async def go():
        channel, demux = OutputChannel(), Demux()
        queues = {f"r{i}": demux.open(f"r{i}") for i in range(4)}
        sent: dict[str, list[int]] = {rid: [] for rid in queues}
        for n, (req, drain) in enumerate(puts):
            rid = f"r{req}"
            channel.put(rid, RequestOutput(rid, [n], str(n)))
            sent[rid].append(n)
            if drain == 0:
                await _drain(channel, demux, [])
        await _drain(channel, demux, [])
        got = {rid: [] for rid in queues}
        for rid, q in queues.items():
            while not q.empty():
                got[rid].extend(q.get_nowait().token_ids)
        return sent, got

    sent, got = asyncio.run(go())
    assert got == sent


def test_a_relay_message_round_trips_and_a_bad_one_is_a_protocol_error_naming_the_field():
    msg = RelayMessage(encode_deltas([RequestOutput("a", [1], "x")]), [("b", "verifier died")])
    assert decode_relay(encode_relay(msg)) == msg
    bad = {"m": "relay", "v": 1, "deltas": msg.deltas, "errors": [["b", 3]]}
    with pytest.raises(ProtocolError, match="relay.errors"):
        decode_relay(pack(bad))
    with pytest.raises(ProtocolError, match="relay.deltas"):
        decode_relay(pack({**bad, "errors": [], "deltas": "text"}))
    with pytest.raises(ProtocolError, match="version"):
        decode_relay(pack({**bad, "errors": [], "v": 2}))
    demux = Demux()
    queue = demux.open("a")
    with pytest.raises(ProtocolError):
        demux.deliver(b"not msgpack")
    assert queue.empty()
