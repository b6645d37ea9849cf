"""pipeline.protocol: round trip, and every kind of malformed payload raises ProtocolError."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.output_support import f64, i32

from pipeline.protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    StepColumns,
    VerifyStep,
    columns_from_step,
    decode,
    decode_columns,
    encode,
    encode_columns,
)

finite = st.floats(min_value=-1e4, max_value=0.0, allow_nan=False, allow_infinity=False)
token = st.integers(0, (1 << 31) - 1)


@st.composite
def verify_steps(draw) -> VerifyStep:
    b = draw(st.integers(0, 6))
    rids = draw(st.lists(st.text(min_size=1, max_size=12), min_size=b, max_size=b, unique=True))
    token_ids = [draw(st.lists(token, min_size=1, max_size=6)) for _ in rids]
    drafted = [len(t) - 1 + draw(st.integers(0, 3)) for t in token_ids]
    logprobs = top = None
    if draw(st.booleans()):
        logprobs = [[draw(finite) for _ in t] for t in token_ids]
    if draw(st.booleans()):
        top = []
        for t in token_ids:
            n = draw(st.integers(0, 4))
            top.append([[(draw(token), draw(finite)) for _ in range(n)] for _ in t])
    tp = draw(st.sampled_from([None, "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"]))
    return VerifyStep(
        step=draw(st.integers(0, 1 << 40)),
        rids=rids,
        token_ids=token_ids,
        drafted=drafted,
        logprobs=logprobs,
        top_logprobs=top,
        traceparent=tp,
        time=draw(st.floats(0, 2e9, allow_nan=False)),
    )


@settings(max_examples=150, deadline=None)
@given(verify_steps())
def test_decode_of_encode_is_the_same_step(step):
    assert decode(encode(step)) == step


@settings(max_examples=50, deadline=None)
@given(verify_steps())
def test_decode_columns_matches_columns_from_step(step):
    a, b = decode_columns(encode(step)), columns_from_step(step)
    assert a.rids == b.rids and a.step == b.step
    for name in ("lengths", "drafted", "tokens", "logprobs", "top_n", "top_ids", "top_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or np.array_equal(x, y)


def valid_message() -> dict:
    step = VerifyStep(
        step=3,
        rids=["a", "b"],
        token_ids=[[5, 6, 7], [8]],
        drafted=[2, 0],
        logprobs=[[-0.1, -0.2, -0.3], [-0.4]],
        top_logprobs=[[[(1, -0.1)], [(2, -0.2)], [(3, -0.3)]], [[(4, -0.4)]]],
        time=1.5,
    )
    return msgpack.unpackb(encode(step), raw=False)


# Each mutation breaks exactly one rule of the contract.
MUTATIONS = {
    "wrong version": lambda m: m.update(v=PROTOCOL_VERSION + 1),
    "version as bool": lambda m: m.update(v=True),
    "version as float": lambda m: m.update(v=float(PROTOCOL_VERSION)),
    "missing key": lambda m: m.pop("lp"),
    "extra key": lambda m: m.update(extra=1),
    "len count mismatch": lambda m: m.update(len=i32(3)),
    "token count mismatch": lambda m: m.update(tok=i32(5, 6, 7)),
    "negative token id": lambda m: m.update(tok=i32(5, -6, 7, 8)),
    "zero accepted": lambda m: m.update(len=i32(0, 4), draft=i32(2, 3)),
    "too many tokens for drafted": lambda m: m.update(draft=i32(1, 0)),
    "negative drafted": lambda m: m.update(draft=i32(2, -1)),
    "NaN logprob": lambda m: m.update(lp=f64(-0.1, math.nan, -0.3, -0.4)),
    "infinite top logprob": lambda m: m.update(tlp=f64(-0.1, -0.2, -math.inf, -0.4)),
    "logprob count mismatch": lambda m: m.update(lp=f64(-0.1)),
    "top ids without counts": lambda m: m.update(tn=None),
    "negative top-N": lambda m: m.update(tn=i32(-1, 1)),
    "top id count mismatch": lambda m: m.update(tid=i32(1, 2)),
    "duplicate rids": lambda m: m.update(rids=["a", "a"]),
    "empty rid": lambda m: m.update(rids=["a", ""]),
    "rid not a string": lambda m: m.update(rids=["a", 7]),
    "rids not a list": lambda m: m.update(rids="ab"),
    "tokens not bin": lambda m: m.update(tok=[5, 6, 7, 8]),
    "negative step": lambda m: m.update(step=-1),
    "step as float": lambda m: m.update(step=1.5),
    "bad traceparent": lambda m: m.update(tp="not-a-traceparent"),
    "NaN time": lambda m: m.update(t=math.nan),
    "time as string": lambda m: m.update(t="now"),
    "huge len values": lambda m: m.update(len=i32(1 << 30, 1 << 30)),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_malformed_message_raises_protocol_error(name):
    msg = valid_message()
    MUTATIONS[name](msg)
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(msg, use_bin_type=True))


def test_the_unmutated_message_decodes():
    # Guards the table above: each case fails for its mutation, not for a broken base message.
    step = decode(msgpack.packb(valid_message(), use_bin_type=True))
    assert step.token_ids == [[5, 6, 7], [8]] and step.top_logprobs[1] == [[(4, -0.4)]]


def test_every_truncation_of_a_payload_raises_protocol_error():
    payload = msgpack.packb(valid_message(), use_bin_type=True)
    for k in range(len(payload)):
        with pytest.raises(ProtocolError):
            decode(payload[:k])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_protocol_error(raw):
    with pytest.raises(ProtocolError):
        decode(raw)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_byte_flips_either_decode_validly_or_raise_protocol_error(data):
    payload = bytearray(msgpack.packb(valid_message(), use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    try:
        step = decode(bytes(payload))
    except ProtocolError:
        return
    # A flip that still decodes must give a step that satisfies the contract.
    assert all(1 <= len(t) <= d + 1 for t, d in zip(step.token_ids, step.drafted))
    assert all(x >= 0 for t in step.token_ids for x in t)


def test_non_bytes_payload_raises_protocol_error():
    with pytest.raises(ProtocolError):
        decode("not bytes")  # type: ignore[arg-type]


BAD_STEPS = {
    "float token id": {"token_ids": [[1.5]], "drafted": [0]},
    "bool token id": {"token_ids": [[True]], "drafted": [0]},
    "string token id": {"token_ids": [["3"]], "drafted": [0]},
    "token id over int32": {"token_ids": [[1 << 31]], "drafted": [0]},
    "token list not a list": {"token_ids": [5], "drafted": [0]},
    "drafted too short": {"token_ids": [[1, 2]], "drafted": [0]},
    "rids and tokens differ": {"token_ids": [[1], [2]], "drafted": [0, 0]},
    "None logprob": {"token_ids": [[1]], "drafted": [0], "logprobs": [[None]]},
    "top entry not a pair": {
        "token_ids": [[1]],
        "drafted": [0],
        "top_logprobs": [[[(1, -0.1, 3)]]],
    },
    "ragged top-N": {
        "token_ids": [[1, 2]],
        "drafted": [1],
        "top_logprobs": [[[(1, -0.1)], [(1, -0.1), (2, -0.2)]]],
    },
}


@pytest.mark.parametrize("name", sorted(BAD_STEPS))
def test_encode_rejects_a_malformed_step(name):
    step = VerifyStep(step=0, rids=["r"], **BAD_STEPS[name])
    with pytest.raises(ProtocolError):
        encode(step)


def test_columns_with_top_counts_but_no_top_arrays_are_rejected():
    cols = StepColumns(
        step=0,
        rids=["r"],
        lengths=np.array([1]),
        drafted=np.array([0]),
        tokens=np.array([4]),
        top_n=np.array([1]),
    )
    with pytest.raises(ProtocolError):
        encode_columns(cols)
