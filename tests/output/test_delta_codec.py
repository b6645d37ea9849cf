"""The output stage's deltas as msgpack: every field round-trips, and bad bytes are refused."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.output.delta_codec import (
    DELTA_FIELDS,
    RARE_FIELDS,
    ROW_COLUMNS,
    decode_deltas,
    encode_deltas,
)
from pipeline.output.request_output import RequestOutput
from pipeline.protocol import ProtocolError

token = st.integers(0, 50_000)
count = st.integers(0, 1 << 40)
logprob = st.floats(-1e4, 0.0)


@st.composite
def deltas(draw) -> RequestOutput:
    ids = draw(st.lists(token, max_size=6))
    return RequestOutput(
        rid=draw(st.text(min_size=1, max_size=12)),
        token_ids=ids,
        text=draw(st.text(max_size=20)),
        logprobs=[draw(logprob) for _ in ids] if draw(st.booleans()) else None,
        top_logprobs=[draw(st.lists(st.tuples(token, logprob), max_size=3)) for _ in ids]
        if draw(st.booleans()) else None,
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


@settings(max_examples=300, deadline=None)
@given(st.lists(deltas(), max_size=8))
def test_every_delta_round_trips(batch):
    assert decode_deltas(encode_deltas(batch)) == batch


def test_the_wire_names_every_request_output_field():
    assert DELTA_FIELDS == tuple(f.name for f in dataclasses.fields(RequestOutput))
    assert set(RARE_FIELDS) < set(DELTA_FIELDS)


def test_a_plain_msgpack_reader_reads_the_columns():
    batch = [RequestOutput("r", [1, 2], "ab", logprobs=[-0.5, -1.0], spec_verify_ct=3),
             RequestOutput("s", [7], spec_acceptance_histogram=[4])]
    msg = msgpack.unpackb(encode_deltas(batch))
    assert msg["m"] == "deltas" and msg["v"] == 2 and msg["rid"] == ["r", "s"]
    rows = dict(zip(ROW_COLUMNS, np.frombuffer(msg["rows"], "<i8").reshape(-1, 2).tolist()))
    assert rows["len"] == [2, 1] and rows["lp"] == [1, 0] and rows["vct"] == [3, 0]
    assert np.frombuffer(msg["ints"], "<i4").tolist() == [1, 2, 7, 4]  # tok, then h
    assert np.frombuffer(msg["lps"], "<f8").tolist() == [-0.5, -1.0]
    assert msg["rare"] == []  # nothing finished: no row carries a finish


def test_only_rows_with_a_finish_or_error_travel_in_rare():
    batch = [RequestOutput("a"), RequestOutput("b", finished=True, finish_reason="stop",
                                               finish_kind="eos", finished_len=3, finish_step=9),
             RequestOutput("c", cached_tokens=16)]
    msg = msgpack.unpackb(encode_deltas(batch))
    assert [row[0] for row in msg["rare"]] == [1, 2]


def _bad(msg: dict) -> str:
    with pytest.raises(ProtocolError) as err:
        decode_deltas(msgpack.packb(msg))
    return str(err.value)


def _set(key, value):
    return lambda msg: msg.__setitem__(key, value)


def _row(name, value):
    """Set column `name` of the one delta's rows."""
    def change(msg):
        rows = np.frombuffer(msg["rows"], "<i8").copy()
        rows[ROW_COLUMNS.index(name)] = value
        msg["rows"] = rows.tobytes()
    return change


def _i32(*values):
    return np.array(values, "<i4").tobytes()


def _f64(*values):
    return np.array(values, "<f8").tobytes()


# One delta: 2 ids, 2 logprobs, top-logprobs of 1 and 0 alternatives, a histogram of 2; so
# ints = tok [1, 2] + tn [1, 0] + tid [3] + h [1, 0] and lps = lpv [-1, -2] + tlp [-1.5].
@pytest.mark.parametrize("change, field", [
    (_set("ints", b"\x00\x00"), "deltas.ints"),  # not whole int32s
    (_set("ints", _i32(1, -3, 1, 0, 3, 1, 0)), "deltas.ints"),  # a negative token id
    (_set("ints", _i32(1, 2, 1, 0, 3, 1)), "deltas.ints"),  # one value short
    (_set("ints", _i32(1, 2, 2, 0, 3, 1, 0)), "deltas.ints"),  # tn says 2 alternatives, 1 sent
    (_set("lps", _f64(-1.0, -2.0)), "deltas.lps"),  # the top alternative's logprob is missing
    (_set("lps", _f64(-1.0, np.nan, -1.5)), "deltas.lps"),
    (_set("rows", b"\x00" * 8), "deltas.rows"),  # 1 value for 8 columns
    (_row("fin", 2), "deltas.rows.fin"),
    (_row("lp", -1), "deltas.rows.lp"),
    (_row("vct", -1), "deltas.rows.vct"),
    (_row("len", 1 << 40), "deltas.rows.len"),
    (_set("rid", [""]), "deltas.rid"),
    (_set("text", ["a", "b"]), "deltas.text"),
    (_set("rare", [[1, "stop", None, None, None, None, None, None]]), "rare.row"),  # no row 1
    (_set("rare", [[0, 5, None, None, None, None, None, None]]), "finish_reason"),
    (_set("rare", [[0, None, None, None, -1, None, None, None]]), "finished_len"),
    (_set("rare", [[0, None, None]]), "rare"),
    (lambda msg: msg.pop("lps"), "missing fields ['lps']"),
])
def test_a_bad_message_is_refused_naming_the_field(change, field):
    one = RequestOutput("r", [1, 2], "ab", logprobs=[-1.0, -2.0], top_logprobs=[[(3, -1.5)], []],
                        spec_acceptance_histogram=[1, 0])
    msg = msgpack.unpackb(encode_deltas([one]))
    assert decode_deltas(msgpack.packb(msg)) == [one]
    change(msg)
    assert field in _bad(msg)


def test_a_repeated_rare_row_is_refused():
    msg = msgpack.unpackb(encode_deltas([RequestOutput("r", finish_reason="stop"),
                                         RequestOutput("s", finish_reason="stop")]))
    msg["rare"][1][0] = 0
    assert "rare.row" in _bad(msg)


@settings(max_examples=300, deadline=None)
@given(st.lists(deltas(), min_size=1, max_size=4), st.data())
def test_a_changed_field_is_refused_or_decodes_to_deltas(batch, data):
    """Any field swapped for other msgpack data: a ProtocolError or well-formed deltas, never
    another exception (an IndexError, a TypeError) from a check that trusted a length."""
    msg = msgpack.unpackb(encode_deltas(batch))
    key = data.draw(st.sampled_from(sorted(set(msg) - {"v", "m"})))
    value = msg[key]
    junk = st.none() | st.integers(-3, 300) | st.binary(max_size=40) | st.text(max_size=4)
    how = data.draw(st.sampled_from(["other", "shorter", "longer", "byte"]))
    if how == "other" or not value:
        msg[key] = data.draw(junk | st.lists(junk | st.lists(junk, max_size=8), max_size=6))
    elif how == "shorter":  # one item or one byte less: a count that no longer adds up
        msg[key] = value[:-1]
    elif how == "longer":
        msg[key] = value + value[:1]
    elif type(value) is bytes:  # one byte changed: a flag, a length, a value out of range
        at = data.draw(st.integers(0, len(value) - 1))
        msg[key] = value[:at] + bytes([data.draw(st.integers(0, 255))]) + value[at + 1:]
    else:
        msg[key] = [data.draw(junk), *value[1:]]
    try:
        out = decode_deltas(msgpack.packb(msg))
    except ProtocolError:
        return
    assert all(isinstance(d, RequestOutput) for d in out)
    for d in out:
        assert d.logprobs is None or len(d.logprobs) == len(d.token_ids)
        assert d.top_logprobs is None or len(d.top_logprobs) == len(d.token_ids)


def test_the_encoder_refuses_logprobs_that_do_not_align():
    with pytest.raises(ProtocolError, match="logprobs"):
        encode_deltas([RequestOutput("r", [1, 2], logprobs=[-1.0])])
    with pytest.raises(ProtocolError, match="top_logprobs"):
        encode_deltas([RequestOutput("r", [1], top_logprobs=[])])


@pytest.mark.parametrize("version", [1, 3, True])
def test_an_unknown_version_is_refused(version):
    msg = msgpack.unpackb(encode_deltas([]))
    msg["v"] = version
    with pytest.raises(ProtocolError, match="version"):
        decode_deltas(msgpack.packb(msg))
