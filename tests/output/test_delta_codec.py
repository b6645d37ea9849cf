"""The output stage's deltas as msgpack: every field round-trips, and bad bytes are refused."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.output.delta_codec import DELTA_FIELDS, decode_deltas, encode_deltas
from pipeline.output.request_output import RequestOutput
from pipeline.protocol import ProtocolError

token = st.integers(0, 50_000)
count = st.integers(0, 1 << 40)
logprob = st.floats(-1e4, 0.0)


@st.composite
def deltas(draw) -> RequestOutput:
    ids = draw(st.lists(token, max_size=6))
    with_lp = draw(st.booleans())
    return RequestOutput(
        rid=draw(st.text(min_size=1, max_size=12)),
        token_ids=ids,
        text=draw(st.text(max_size=20)),
        logprobs=[draw(logprob) for _ in ids] if with_lp else None,
        top_logprobs=[draw(st.lists(st.tuples(token, logprob), max_size=3)) for _ in ids]
        if with_lp else None,
        finished=draw(st.booleans()),
        finish_reason=draw(st.sampled_from([None, "stop", "length", "abort", "error"])),
        finish_kind=draw(st.sampled_from([None, "eos", "stop_string", "grammar_error"])),
        matched_stop=draw(st.none() | token | st.text(max_size=5)),
        finished_len=draw(st.none() | count),
        finish_step=draw(st.none() | count),
        spec_verify_ct=draw(count),
        spec_accepted_tokens=draw(count),
        spec_acceptance_histogram=draw(st.lists(st.integers(0, 1 << 30), max_size=6)),
        spec_draft_tokens=draw(count),
        error=draw(st.none() | st.text(max_size=30)),
        cached_tokens=draw(st.none() | count),
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(deltas(), max_size=5))
def test_every_delta_round_trips(batch):
    assert decode_deltas(encode_deltas(batch)) == batch


def test_the_wire_names_every_request_output_field():
    assert DELTA_FIELDS == tuple(f.name for f in dataclasses.fields(RequestOutput))


def test_a_plain_msgpack_reader_reads_the_deltas():
    msg = msgpack.unpackb(encode_deltas([RequestOutput("r", [1, 2], "ab")]))
    assert msg["m"] == "deltas" and msg["v"] == 1 and msg["d"][0][0] == "r"


@pytest.mark.parametrize("change, field", [
    (lambda row: row.__setitem__(1, b"\x00\x00"), "token_ids"),  # not whole int32s
    (lambda row: row.__setitem__(3, b"\x00" * 8), "logprobs"),  # 1 logprob for 0 tokens
    (lambda row: row.__setitem__(5, 1), "finished"),
    (lambda row: row.__setitem__(11, -1), "spec_verify_ct"),
    (lambda row: row.pop(), "fields"),
])
def test_a_bad_delta_is_refused_naming_the_field(change, field):
    msg = msgpack.unpackb(encode_deltas([RequestOutput("r")]))
    change(msg["d"][0])
    with pytest.raises(ProtocolError, match=field):
        decode_deltas(msgpack.packb(msg))


def test_an_unknown_version_is_refused():
    msg = msgpack.unpackb(encode_deltas([]))
    msg["v"] = 2
    with pytest.raises(ProtocolError, match="version"):
        decode_deltas(msgpack.packb(msg))
