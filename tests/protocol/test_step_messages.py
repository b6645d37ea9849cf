"""The engine <-> stage step messages (plan, new request, proposal, outcome) as msgpack: a plain
msgpack reader sees only maps, lists, strings, numbers and bytes with a version tag; decoding
gives back the same message; a malformed payload is refused with a ProtocolError naming it."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.params import SamplingParams
from pipeline.protocol import (
    SAMPLING_FIELDS,
    NewRequest,
    Proposal,
    ProtocolError,
    StepOutcome,
    StepPlan,
    decode_new_request,
    decode_outcome,
    decode_plan,
    decode_proposal,
    encode,
    encode_new_request,
    encode_outcome,
    encode_plan,
    encode_proposal,
)
from pipeline.protocol.verify_step import VerifyStep

TP = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
rid = st.text(min_size=1, max_size=10)
token = st.integers(0, (1 << 31) - 1)
small = st.integers(0, 1000)


def plain(obj) -> bool:
    """Only what msgpack itself makes: no ext types, no custom objects."""
    if isinstance(obj, dict):
        return all(type(k) is str and plain(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(plain(v) for v in obj)
    return obj is None or type(obj) in (bool, int, float, str, bytes)


@st.composite
def sampling_params(draw) -> SamplingParams:
    n = draw(st.integers(1, 64))
    return SamplingParams(
        max_new_tokens=n, stop=draw(st.lists(st.text(min_size=1, max_size=5), max_size=2)),
        stop_token_ids=draw(st.lists(small, max_size=3)), ignore_eos=draw(st.booleans()),
        include_stop_str_in_output=draw(st.booleans()), skip_special_tokens=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, 20)),
        temperature=draw(st.sampled_from([0.0, 0.7, 1.5, 2.0])),
        top_p=draw(st.sampled_from([1.0, 0.9])), top_k=draw(st.sampled_from([-1, 0, 40])),
        seed=draw(st.none() | st.integers(0, (1 << 63) - 1)),
        min_new_tokens=draw(st.integers(0, n)))


@st.composite
def new_requests(draw, rid_strategy=rid) -> NewRequest:
    prompt = draw(st.lists(token, min_size=1, max_size=8))
    return NewRequest(draw(rid_strategy), prompt, draw(sampling_params()),
                      tenant=draw(st.sampled_from(["", "0123456789abcdef" * 2])),
                      num_output=draw(st.integers(0, len(prompt) - 1)))


@st.composite
def plans(draw) -> StepPlan:
    ids = draw(st.lists(rid, max_size=8, unique=True))
    n_new = draw(st.integers(0, len(ids)))
    d = len(ids) - n_new
    scored = draw(st.booleans())
    return StepPlan(
        step=draw(st.integers(0, 1 << 40)),
        release=draw(st.lists(rid, max_size=3)),
        new=[draw(new_requests(st.just(r))) for r in ids[:n_new]],
        decode=ids[n_new:],
        last_tokens=draw(st.lists(token, min_size=d, max_size=d)),
        kv_lens=draw(st.lists(small, min_size=d, max_size=d)),
        num_outputs=draw(st.lists(small, min_size=d, max_size=d)),
        ks=draw(st.lists(st.integers(0, 8), min_size=d, max_size=d)),
        caps=draw(st.lists(st.integers(0, 8), min_size=d, max_size=d)) if scored else [],
        min_gains=draw(st.lists(st.floats(0, 2) | st.just(float("inf")), min_size=d, max_size=d))
        if scored else [],
        commits=draw(st.dictionaries(rid, st.lists(token, min_size=1, max_size=5), max_size=3)),
        finals=draw(st.dictionaries(rid, st.lists(token, max_size=5), max_size=2)),
        traceparent=draw(st.sampled_from([None, TP])))


@st.composite
def proposals(draw) -> Proposal:
    tokens = draw(st.lists(st.lists(token, max_size=5), max_size=6))
    probs = confidence = None
    if draw(st.booleans()):
        vocab = draw(st.integers(1, 7))
        probs = [torch.rand(len(t), vocab) if draw(st.booleans()) else None for t in tokens]
    if draw(st.booleans()):
        confidence = [draw(st.lists(st.floats(0, 1), min_size=len(t), max_size=len(t)))
                      for t in tokens]
    return Proposal(tokens, probs, confidence, draw(st.floats(0, 10)))


@st.composite
def outcomes(draw) -> StepOutcome:
    ids = draw(st.lists(rid, max_size=6, unique=True))
    tokens = [draw(st.lists(token, min_size=1, max_size=5)) for _ in ids]
    expected = None
    if draw(st.booleans()):
        expected = [draw(st.none() | st.floats(0, 8)) for _ in ids]
    return StepOutcome(
        step=draw(st.integers(0, 1 << 40)), rids=ids, tokens=tokens,
        drafted=[len(t) - 1 + draw(st.integers(0, 3)) for t in tokens], expected=expected,
        decode_s=draw(st.none() | st.floats(0, 5)),
        cached=draw(st.lists(st.integers(0, 4096), max_size=len(ids))))


def same_proposal(a: Proposal, b: Proposal) -> bool:
    if a.tokens != b.tokens or a.confidence != b.confidence or a.seconds != b.seconds:
        return False
    if (a.probs is None) != (b.probs is None):
        return False
    return a.probs is None or all(
        (p is None and q is None) or np.array_equal(np.asarray(p), np.asarray(q))
        for p, q in zip(a.probs, b.probs))


# --- round trips ------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(plans())
def test_a_plan_decodes_to_the_plan_it_was_encoded_from(plan):
    assert decode_plan(encode_plan(plan)) == plan


@settings(max_examples=100, deadline=None)
@given(new_requests())
def test_a_new_request_decodes_to_the_request_it_was_encoded_from(req):
    assert decode_new_request(encode_new_request(req)) == req


@settings(max_examples=100, deadline=None)
@given(proposals())
def test_a_proposal_decodes_to_the_proposal_it_was_encoded_from(proposal):
    assert same_proposal(decode_proposal(encode_proposal(proposal)), proposal)


@settings(max_examples=100, deadline=None)
@given(outcomes())
def test_an_outcome_decodes_to_the_outcome_it_was_encoded_from(outcome):
    got = decode_outcome(encode_outcome(outcome))
    assert got == dataclasses.replace(outcome, payload=b"")  # the payload travels on its own


def test_a_compiled_grammar_crosses_inside_the_params():
    from pipeline.grammar.llg import Grammar

    req = NewRequest("g", [1, 2], SamplingParams(grammar=Grammar("regex", '{"x": "y"}')))
    assert decode_new_request(encode_new_request(req)).params.grammar == req.params.grammar


def test_the_wire_carries_every_sampling_params_field():
    assert SAMPLING_FIELDS == tuple(f.name for f in dataclasses.fields(SamplingParams))


# --- what a plain msgpack reader sees ---------------------------------------------------------
PLAN = StepPlan(step=4, release=["x"],
                new=[NewRequest("n", [1, 2, 3], SamplingParams(), "ab" * 16, num_output=1)],
                decode=["a", "b"], last_tokens=[7, -1], kv_lens=[10, 12], num_outputs=[3, 5],
                ks=[2, 0], caps=[4, 4], min_gains=[0.5, 1.5], commits={"a": [6, 7]},
                finals={"x": [9]}, traceparent=TP)
PROPOSAL = Proposal([[5, 6], []], [torch.full((2, 3), 0.25), None], [[0.9, 0.5], []], 0.01)
OUTCOME = StepOutcome(4, ["n", "a", "b"], [[11], [5, 6, 1], [2]], [0, 2, 0], [None, 1.4, 0.0],
                      decode_s=0.02, cached=[32])
ENCODED = {
    "plan": encode_plan(PLAN),
    "new": encode_new_request(PLAN.new[0]),
    "proposal": encode_proposal(PROPOSAL),
    "outcome": encode_outcome(OUTCOME),
}


@pytest.mark.parametrize("kind", sorted(ENCODED))
def test_a_plain_msgpack_reader_reads_each_message_with_its_version_tag(kind):
    msg = msgpack.unpackb(ENCODED[kind])
    assert plain(msg) and msg["m"] == kind and msg["v"] == {"outcome": 3, "plan": 3}.get(kind, 1)


def test_the_verify_step_reads_plainly_too():
    msg = msgpack.unpackb(encode(VerifyStep(1, ["a"], [[3]], [0])))
    assert plain(msg) and msg["v"] == 1


def test_plan_columns_are_int32_and_float64_bins():
    msg = msgpack.unpackb(ENCODED["plan"])
    assert np.frombuffer(msg["kv"], "<i4").tolist() == [10, 12]
    assert np.frombuffer(msg["gain"], "<f8").tolist() == [0.5, 1.5]
    assert np.frombuffer(msg["com"]["a"], "<i4").tolist() == [6, 7]
    assert msg["new"][0]["params"]["max_new_tokens"] == 16
    assert msg["dec"] == ["a", "b"] and msg["tp"] == TP


def test_draft_probabilities_travel_as_one_float32_bin():
    msg = msgpack.unpackb(ENCODED["proposal"])
    assert msg["pv"] == 3 and list(msg["pm"]) == [1, 0]
    assert np.frombuffer(msg["pq"], "<f4").tolist() == [0.25] * 6


# --- strict decoding --------------------------------------------------------------------------
def tampered(kind: str, **changes) -> bytes:
    msg = msgpack.unpackb(ENCODED[kind])
    for key, value in changes.items():
        if value is KeyError:
            del msg[key]
        else:
            msg[key] = value
    return msgpack.packb(msg, use_bin_type=True)


DECODERS = {"plan": decode_plan, "new": decode_new_request, "proposal": decode_proposal,
            "outcome": decode_outcome}
i32 = np.int32


@pytest.mark.parametrize(("kind", "changes", "error"), [
    ("plan", {"v": 1}, "unsupported version 1"),
    ("plan", {"v": True}, "unsupported version True"),
    ("plan", {"m": "proposal"}, "expected a 'plan' message"),
    ("plan", {"extra": 1}, "unknown fields ['extra']"),
    ("plan", {"kv": KeyError}, "missing fields ['kv']"),
    ("plan", {"kv": np.array([1], i32).tobytes()}, "plan.kv: expected 2"),
    ("plan", {"kv": [10, 12]}, "plan.kv must be a bin array"),
    ("plan", {"ks": np.array([2, -1], i32).tobytes()}, "plan.ks: values must be in"),
    ("plan", {"caps": np.array([4], i32).tobytes()}, "plan.caps: expected 2"),
    ("plan", {"gain": np.array([0.5, np.nan]).tobytes()}, "plan.gain: values must be finite"),
    ("plan", {"gain": np.array([0.5, -np.inf]).tobytes()}, "plan.gain: values must be finite"),
    ("plan", {"dec": ["a", "a"]}, "appears twice"),
    ("plan", {"dec": ["a", ""]}, "plan.dec: bad request id ''"),
    ("plan", {"step": -1}, "plan.step must be an integer"),
    ("plan", {"step": 1.0}, "plan.step must be an integer"),
    ("plan", {"tp": "nope"}, "bad plan.tp"),
    ("plan", {"com": {"a": [1]}}, "plan.com['a'] must be a bin array"),
    ("new", {"params": {"max_new_tokens": 4}}, "missing fields"),
    ("new", {"prompt": b"\x01"}, "new.prompt: 1 bytes are no whole number of int32"),
    ("proposal", {"n": np.array([2, 1], i32).tobytes()}, "proposal.tok: expected 3"),
    ("proposal", {"pq": b"\x00" * 8}, "proposal.pq: expected 6"),
    ("proposal", {"pm": np.array([2, 0], np.uint8).tobytes()}, "flags must be 0 or 1"),
    ("proposal", {"pm": None}, "proposal.pm must be a bin array"),
    ("proposal", {"pq": np.full(6, np.inf, np.float32).tobytes()}, "must be finite"),
    ("proposal", {"cf": np.zeros(1).tobytes()}, "proposal.cf: expected 2"),
    ("proposal", {"s": -1.0}, "proposal.s must be a finite number"),
    ("outcome", {"len": np.array([1, 4, 1], i32).tobytes()}, "at most drafted + 1"),
    ("outcome", {"len": np.array([1, 0, 1], i32).tobytes()}, "outcome.len: values must be in"),
    ("outcome", {"rids": ["n", "a", "a"]}, "duplicate request ids"),
    ("outcome", {"exp": [None]}, "outcome.exp must be nil or one entry per request"),
    ("outcome", {"exp": [None, "1", 0.0]}, "outcome.exp must be a finite number"),
])
def test_a_malformed_message_is_refused_with_the_field_named(kind, changes, error):
    with pytest.raises(ProtocolError) as e:
        DECODERS[kind](tampered(kind, **changes))
    assert error in str(e.value)


def test_bad_sampling_params_on_the_wire_are_refused_naming_the_field():
    msg = msgpack.unpackb(ENCODED["new"])
    msg["params"]["top_p"] = 0.0
    with pytest.raises(ProtocolError, match=r"new.params: top_p: must be a finite number in \(0, 1\]"):
        decode_new_request(msgpack.packb(msg))


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_no_decoder_takes_another_kind_of_message(kind):
    for other, payload in ENCODED.items():
        if other != kind:
            with pytest.raises(ProtocolError, match="expected a"):
                DECODERS[kind](payload)


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_a_payload_that_is_not_msgpack_bytes_is_refused(kind):
    for payload in (PLAN, b"\xc1", msgpack.packb([1, 2])):
        with pytest.raises(ProtocolError):
            DECODERS[kind](payload)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(DECODERS)), st.data())
def test_any_damage_to_a_message_raises_protocol_error_or_decodes_whole(kind, data):
    raw = bytearray(ENCODED[kind])
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        DECODERS[kind](bytes(raw))
    except ProtocolError:
        pass  # refused whole; any other exception type fails the test


def test_a_matcher_factory_grammar_cannot_cross_a_process():
    req = NewRequest("f", [1], SamplingParams(grammar=lambda: None))
    with pytest.raises(ProtocolError, match="params.grammar: only a compiled Grammar"):
        encode_new_request(req)


def test_encoding_refuses_values_that_do_not_fit_the_columns():
    with pytest.raises(ProtocolError, match="kv_lens"):
        encode_plan(StepPlan(0, decode=["a"], last_tokens=[1], kv_lens=[1 << 40],
                             num_outputs=[1], ks=[1]))
    with pytest.raises(ProtocolError, match="proposal.probs\\[0\\]: shape"):
        encode_proposal(Proposal([[1, 2]], [torch.zeros(1, 4)]))


def test_a_plans_last_token_is_a_token_or_minus_one_for_the_verifiers_own_sample():
    plan = StepPlan(0, decode=["a", "b"], last_tokens=[-1, 5], kv_lens=[3, 4],
                    num_outputs=[1, 2], ks=[0, 0])
    assert decode_plan(encode_plan(plan)).last_tokens == [-1, 5]
    with pytest.raises(ProtocolError, match="last"):
        decode_plan(encode_plan(dataclasses.replace(plan, last_tokens=[-2, 5])))


# --- the draft bound --------------------------------------------------------------------------
def test_the_draft_bound_is_the_caps_or_else_the_controllers_ks():
    assert StepPlan(0, decode=["a", "b"], ks=[1, 0], caps=[4, 2]).draft_bounds == [4, 2]
    assert StepPlan(0, decode=["a", "b"], ks=[3, 1]).draft_bounds == [3, 1]


def test_the_draft_limit_never_passes_the_slot():
    plan = StepPlan(0, decode=["a", "b", "c"], kv_lens=[10, 94, 99], ks=[4, 4, 4])
    assert plan.draft_limits(max_len=100) == [4, 4, 0]


def test_a_new_request_whose_resumed_output_is_not_inside_its_prefill_is_refused():
    msg = msgpack.unpackb(ENCODED["new"])
    msg["nout"] = len(PLAN.new[0].prompt_ids)  # every prefill token "output": no prompt left
    with pytest.raises(ProtocolError, match=r"new.nout"):
        decode_new_request(msgpack.packb(msg))


def test_a_tenant_longer_than_a_hash_is_refused():
    msg = msgpack.unpackb(ENCODED["new"])
    msg["tenant"] = "t" * 65
    with pytest.raises(ProtocolError, match=r"new.tenant"):
        decode_new_request(msgpack.packb(msg))
