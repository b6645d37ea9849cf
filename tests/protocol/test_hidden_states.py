"""The aux hidden states an EAGLE-3 draft needs cross from the verifier in the outcome and on to
the draft stage in the next plan: a versioned message of their own, the same values back in
every dtype, refused when malformed, and absent (the old bytes but the version) when None."""

from __future__ import annotations

import msgpack
import pytest
import torch

from pipeline.protocol import (
    HiddenStates,
    ProtocolError,
    StepOutcome,
    StepPlan,
    decode_hidden,
    decode_outcome,
    decode_plan,
    encode_hidden,
    encode_outcome,
    encode_plan,
)


def states(dtype: torch.dtype = torch.bfloat16) -> HiddenStates:
    rows = torch.randn(5, 12, generator=torch.Generator().manual_seed(0)).to(dtype)
    return HiddenStates(["a", "b"], [0, 7], [3, 2], rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_states_round_trip_in_the_outcome_and_the_plan(dtype):
    h = states(dtype)
    outcome = decode_outcome(encode_outcome(StepOutcome(1, ["a"], [[4]], [0], hidden=h)))
    plan = decode_plan(encode_plan(StepPlan(2, hidden=h)))
    for got in (outcome.hidden, plan.hidden):
        assert (got.rids, got.starts, got.counts) == (h.rids, h.starts, h.counts)
        assert got.rows.dtype == dtype and torch.equal(got.rows, h.rows)
        assert [r.shape[0] for r in got.split()] == [3, 2]


def test_the_states_are_their_own_versioned_message_and_left_off_when_none():
    raw = msgpack.unpackb(encode_plan(StepPlan(2, hidden=states())))
    inner = msgpack.unpackb(raw["hid"])
    assert (inner["v"], inner["m"], inner["dt"], inner["w"]) == (1, "hidden", "bf16", 12)
    assert len(inner["x"]) == 5 * 12 * 2
    assert "hid" not in msgpack.unpackb(encode_plan(StepPlan(2)))
    assert decode_plan(encode_plan(StepPlan(2))).hidden is None


def tampered(**changes) -> bytes:
    msg = msgpack.unpackb(encode_hidden(states()))
    msg.update(changes)
    return msgpack.packb(msg, use_bin_type=True)


@pytest.mark.parametrize(("changes", "error"), [
    ({"v": 2}, "unsupported version 2"),
    ({"dt": "f64"}, "unknown dtype 'f64'"),
    ({"x": b"\x00" * 10}, "expected 5 x 12 bf16 values"),
    ({"w": 0}, "hidden.w"),
    ({"rids": ["a", "a"]}, "duplicate request ids"),
    ({"n": b"\x01\x00\x00\x00"}, "hidden.n: expected 2"),
])
def test_a_malformed_message_is_refused_naming_the_field(changes, error):
    with pytest.raises(ProtocolError, match=error):
        decode_hidden(tampered(**changes))


def test_rows_that_do_not_match_the_counts_are_refused_at_encode():
    h = states()
    h.counts = [3, 3]
    with pytest.raises(ProtocolError, match="5 rows for 6 positions"):
        encode_hidden(h)
