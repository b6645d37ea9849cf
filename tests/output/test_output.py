"""pipeline.output.OutputProcessor: the known failure cases of other engines, the logprob boundary,
speculative statistics, drops, abort, and malformed steps leaving every request untouched."""

from __future__ import annotations

import dataclasses
import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.output_support import (
    EOS,
    PLAIN_ADDED,
    STOP,
    Collected,
    byte_id,
    feed,
    i32,
    make_step,
    text_ids,
    tiny_tokenizer,
    token_logprob,
    token_top,
)

from pipeline.grammar import choice_grammar
from pipeline.output.processor import OutputProcessor
from pipeline.params import SamplingParams
from pipeline.protocol import ProtocolError, VerifyStep, encode

TINY = tiny_tokenizer()


def proc_with(params: SamplingParams, rid: str = "r", tokenizer=TINY) -> OutputProcessor:
    proc = OutputProcessor(tokenizer, [EOS])
    proc.add_request(rid, [1, 2, 3], params)
    return proc


def step(proc, k: int, windows: dict, top_n: int = 5, extra_drafts: int = 0) -> list:
    return proc.process(encode(make_step(k, windows, top_n, extra_drafts)))


# -- the failure cases of other engines --------------------------------------------------------


def test_stop_string_mid_window_drops_everything_after_it():
    proc = proc_with(SamplingParams(max_new_tokens=50, stop=["STOP"], logprobs=2))
    window = text_ids(TINY, "ok STOP and more")
    [out] = step(proc, 0, {"r": (0, window)})
    kept = window[:7]  # "ok STOP": the token holding the stop string's last char ends it
    assert out.token_ids == kept
    assert out.text == "ok "
    assert out.logprobs == [token_logprob(p, t) for p, t in enumerate(kept)]
    assert out.top_logprobs == [token_top(p, 5)[:2] for p in range(7)]
    assert (out.finish_reason, out.matched_stop, out.finished_len) == ("stop", "STOP", 7)
    # statistics: one verify step retaining 7 tokens counts 6 accepted (kept - 1, docs/contracts.md)
    assert (out.spec_verify_ct, out.spec_accepted_tokens, out.spec_draft_tokens) == (1, 6, 15)
    assert out.spec_acceptance_histogram == [0] * 6 + [1]


def test_window_overshooting_max_new_tokens_with_a_stop_token_inside_the_budget_is_stop():
    proc = proc_with(SamplingParams(max_new_tokens=4))
    window = [byte_id(ord("a")), byte_id(ord("b")), EOS, byte_id(ord("c")), byte_id(ord("d"))]
    [out] = step(proc, 0, {"r": (0, window)})
    assert (out.finish_reason, out.matched_stop, out.finished_len) == ("stop", EOS, 3)
    assert out.token_ids == window[:3] and out.text == "ab"


def test_window_overshooting_max_new_tokens_with_a_stop_string_inside_the_budget_is_stop():
    proc = proc_with(SamplingParams(max_new_tokens=4, stop=["b"]))
    [out] = step(proc, 0, {"r": (0, text_ids(TINY, "abcdefg"))})
    assert (out.finish_reason, out.matched_stop, out.finished_len, out.text) == (
        "stop",
        "b",
        2,
        "a",
    )


def test_window_overshooting_max_new_tokens_without_a_stop_is_length():
    proc = proc_with(SamplingParams(max_new_tokens=4, stop=["f"]))
    [out] = step(proc, 0, {"r": (0, text_ids(TINY, "abcdefg"))})
    assert (out.finish_reason, out.finished_len, out.text) == ("length", 4, "abcd")


def test_stop_string_early_in_a_window_longer_than_the_stop_string():
    proc = proc_with(SamplingParams(max_new_tokens=100, stop=["xy"]))
    [out] = step(proc, 0, {"r": (0, text_ids(TINY, "axy" + "z" * 30))})
    assert (out.finished_len, out.text, out.token_ids) == (3, "a", text_ids(TINY, "axy"))


def test_stop_string_starting_in_one_step_and_ending_in_the_next():
    proc = proc_with(SamplingParams(max_new_tokens=100, stop=["STOP"]))
    [first] = step(proc, 0, {"r": (0, text_ids(TINY, "go ST"))})
    assert first.text == "go " and not first.finished  # "ST" is held back
    [second] = step(proc, 1, {"r": (5, text_ids(TINY, "OP!!"))})
    assert second.text == "" and second.token_ids == text_ids(TINY, "OP")
    assert (second.finish_reason, second.matched_stop, second.finished_len) == ("stop", "STOP", 7)


def test_held_back_prefix_is_released_when_the_stop_string_does_not_follow():
    proc = proc_with(SamplingParams(max_new_tokens=100, stop=["STOP"]))
    assert step(proc, 0, {"r": (0, text_ids(TINY, "go ST"))})[0].text == "go "
    assert step(proc, 1, {"r": (5, text_ids(TINY, "ay"))})[0].text == "STay"


def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after():
    params = SamplingParams(max_new_tokens=100, stop=["STOP"], include_stop_str_in_output=True)
    proc = proc_with(params)
    got = Collected(step(proc, 0, {"r": (0, text_ids(TINY, "go ST"))}))
    got.outs += step(proc, 1, {"r": (5, text_ids(TINY, "OP!!"))})
    assert got.text == "go STOP" and got.last.finished_len == 7


def test_stop_string_completing_before_min_new_tokens_is_ignored():
    proc = proc_with(SamplingParams(max_new_tokens=100, min_new_tokens=3, stop=["a"]))
    [out] = step(proc, 0, {"r": (0, text_ids(TINY, "abcabc"))})
    assert (out.finished_len, out.text) == (4, "abc")


def test_eos_before_min_new_tokens_is_ordinary_and_its_text_stays_when_not_skipped():
    params = SamplingParams(max_new_tokens=100, min_new_tokens=2, skip_special_tokens=False)
    proc = proc_with(params)
    [out] = step(proc, 0, {"r": (0, [EOS, byte_id(ord("a")), EOS, byte_id(ord("b"))])})
    assert (out.finish_reason, out.matched_stop, out.finished_len) == ("stop", EOS, 3)
    assert out.text == "<eos>a"  # the finishing EOS is special: its text is not emitted


def test_a_non_special_stop_token_keeps_its_text():
    params = SamplingParams(max_new_tokens=100, stop_token_ids=[PLAIN_ADDED])
    proc = proc_with(params)
    [out] = step(proc, 0, {"r": (0, [byte_id(ord("a")), PLAIN_ADDED, byte_id(ord("b"))])})
    assert (out.text, out.matched_stop, out.finished_len) == ("a<x>", PLAIN_ADDED, 2)


def test_a_huge_stop_token_id_is_found_without_a_huge_table():
    params = SamplingParams(max_new_tokens=10, stop_token_ids=[(1 << 31) - 1])
    proc = proc_with(params, tokenizer=None)
    [out] = step(proc, 0, {"r": (0, [5, (1 << 31) - 1, 6])})
    assert (out.matched_stop, out.finished_len) == ((1 << 31) - 1, 2)
    assert proc._stop_table is None or proc._stop_table.nbytes < 1 << 20


def test_ignore_eos_makes_eos_an_ordinary_token():
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, stop_token_ids=[STOP])
    proc = proc_with(params)
    [out] = step(proc, 0, {"r": (0, [EOS, EOS, STOP, EOS])})
    assert (out.finish_reason, out.matched_stop, out.finished_len) == ("stop", STOP, 3)


def test_length_finish_settles_an_unfinished_character_as_replacement_char():
    proc = proc_with(SamplingParams(max_new_tokens=2))
    [out] = step(proc, 0, {"r": (0, [byte_id(ord("a")), byte_id("世".encode()[0])])})
    assert (out.text, out.finish_reason) == ("a\ufffd", "length")


def test_grammar_end_finishes_with_stop_and_no_matched_stop():
    a, b, c = (byte_id(ord(x)) for x in "abc")
    proc = proc_with(SamplingParams(max_new_tokens=50, grammar=choice_grammar([[a, b], [a, c]])))
    [out] = step(proc, 0, {"r": (0, [a, c, b, b])})
    assert (out.finish_reason, out.matched_stop, out.finished_len, out.text) == (
        "stop",
        None,
        2,
        "ac",
    )


def test_a_token_the_grammar_rejects_ends_the_request_with_an_error_not_stop():
    a, b, c = (byte_id(ord(x)) for x in "abc")
    proc = proc_with(SamplingParams(max_new_tokens=50, grammar=choice_grammar([[a, b]])))
    [out] = step(proc, 0, {"r": (0, [a, c, b])})
    assert (out.finished, out.finish_reason, out.finish_kind, out.finished_len) == (
        True, "error", "grammar_error", 2)  # fmt: skip
    assert out.error == "a token the grammar does not allow"
    assert out.matched_stop is None


def test_an_eos_the_grammar_rejects_is_an_error_not_an_eos_stop():
    a, b = byte_id(ord("a")), byte_id(ord("b"))
    proc = proc_with(SamplingParams(max_new_tokens=50, grammar=choice_grammar([[a, b]])))
    [out] = step(proc, 0, {"r": (0, [a, EOS])})  # "a" alone is not a complete output
    assert (out.finish_reason, out.finish_kind, out.finished_len) == ("error", "grammar_error", 2)


def test_length_before_the_rejected_token_is_a_plain_length_finish():
    a, c = byte_id(ord("a")), byte_id(ord("c"))
    proc = proc_with(SamplingParams(max_new_tokens=1, grammar=choice_grammar([[a, a]])))
    [out] = step(proc, 0, {"r": (0, [a, c])})
    assert (out.finish_reason, out.finished_len, out.error) == ("length", 1, None)


def test_grammar_and_stop_string_at_the_same_token_report_the_stop_string():
    a, b = byte_id(ord("a")), byte_id(ord("b"))
    params = SamplingParams(max_new_tokens=50, stop=["ab"], grammar=choice_grammar([[a, b]]))
    [out] = step(proc_with(params), 0, {"r": (0, [a, b, a])})
    assert (out.matched_stop, out.finished_len, out.text) == ("ab", 2, "")


@pytest.mark.parametrize(
    ("params", "window", "kind", "matched"),
    [
        (SamplingParams(max_new_tokens=9), [byte_id(ord("a")), EOS], "eos", EOS),
        # an EOS id the request also lists in stop_token_ids is its stop token, not "eos"
        (SamplingParams(max_new_tokens=9, stop_token_ids=[EOS]), [EOS], "stop_token", EOS),
        (SamplingParams(max_new_tokens=9, stop_token_ids=[STOP]), [STOP], "stop_token", STOP),
        (SamplingParams(max_new_tokens=9, stop=["b"]), text_ids(TINY, "abc"), "stop_string", "b"),
        (SamplingParams(max_new_tokens=2), text_ids(TINY, "abc"), "length", None),
        (SamplingParams(max_new_tokens=9, grammar=choice_grammar([[byte_id(ord("a"))]])),
         text_ids(TINY, "ab"), "grammar", None),
    ],
)
def test_finish_kind_names_what_ended_the_request(params, window, kind, matched):
    [out] = step(proc_with(params), 0, {"r": (0, window)})
    assert (out.finished, out.finish_kind, out.matched_stop) == (True, kind, matched)
    assert out.finish_reason == ("length" if kind == "length" else "stop")


def test_a_running_delta_has_no_finish_and_an_abort_has_finish_kind_abort():
    proc = proc_with(SamplingParams(max_new_tokens=9, logprobs=0))
    [out] = step(proc, 3, {"r": (0, text_ids(TINY, "ab"))}, extra_drafts=2)
    # every field by name (the processor builds deltas positionally, for speed)
    assert dataclasses.asdict(out) == {
        "rid": "r", "token_ids": text_ids(TINY, "ab"), "text": "ab",
        "logprobs": [token_logprob(0, byte_id(ord("a"))), token_logprob(1, byte_id(ord("b")))],
        "top_logprobs": None, "finished": False, "finish_reason": None, "finish_kind": None,
        "matched_stop": None, "finished_len": None, "finish_step": None,
        "spec_verify_ct": 1, "spec_accepted_tokens": 1, "spec_acceptance_histogram": [0, 1],
        "spec_draft_tokens": 3, "error": None,
        "cached_tokens": None,  # the engine sets it, on a first delta
    }  # fmt: skip
    end = proc.abort("r")
    assert (end.finished, end.finish_reason, end.finish_kind, end.finished_len) == (
        True, "abort", "abort", 2)  # fmt: skip


# -- logprob boundary ----------------------------------------------------------------------------


@pytest.mark.parametrize("n_lp", [None, 0, 1, 3])
def test_each_delta_carries_exactly_the_logprobs_of_its_tokens(n_lp):
    params = SamplingParams(max_new_tokens=9, logprobs=n_lp)
    proc = proc_with(params)
    stream = text_ids(TINY, "abcdefghijklmnop")
    got = feed(proc, "r", stream, [2, 3, 1, 5])
    for o in got.outs:
        assert (o.logprobs is None) == (n_lp is None)
        assert (o.top_logprobs is None) == (not n_lp)
        if n_lp is not None:
            assert len(o.logprobs) == len(o.token_ids)
        if n_lp:
            assert len(o.top_logprobs) == len(o.token_ids)
    assert got.ids == stream[:9]
    if n_lp is not None:
        assert got.logprobs == [token_logprob(p, t) for p, t in enumerate(stream[:9])]
        assert proc.get_state("r") is None  # finished
    if n_lp:
        assert got.top == [token_top(p, 5)[:n_lp] for p in range(9)]


def test_a_step_without_logprobs_for_a_request_that_wants_them_is_a_protocol_error():
    proc = proc_with(SamplingParams(logprobs=0))
    with pytest.raises(ProtocolError):
        proc.process(encode(VerifyStep(0, ["r"], [[5]], [0])))
    assert proc.get_state("r").output_ids.tolist() == []


def test_a_step_with_fewer_top_logprobs_than_asked_is_a_protocol_error():
    proc = proc_with(SamplingParams(logprobs=5))
    with pytest.raises(ProtocolError):
        step(proc, 0, {"r": (0, [5])}, top_n=3)


# -- speculative statistics ----------------------------------------------------------------------


def test_prefill_steps_are_not_verify_steps():
    proc = proc_with(SamplingParams(max_new_tokens=100))
    [out] = proc.process(encode(VerifyStep(0, ["r"], [[5]], [0])))
    assert (out.spec_verify_ct, out.spec_accepted_tokens, out.spec_acceptance_histogram) == (
        0,
        0,
        [],
    )


def test_statistics_count_retained_accepted_drafts():
    proc = proc_with(SamplingParams(max_new_tokens=100))
    proc.process(encode(VerifyStep(0, ["r"], [[5]], [0])))  # prefill
    proc.process(encode(VerifyStep(1, ["r"], [[5, 6, 7]], [4])))  # 2 accepted of 4
    [out] = proc.process(encode(VerifyStep(2, ["r"], [[5]], [4])))  # 0 accepted
    assert out.spec_verify_ct == 2 and out.spec_accepted_tokens == 2
    assert out.spec_acceptance_histogram == [1, 0, 1]


def test_a_truncated_window_counts_only_its_retained_accepted_drafts():
    proc = proc_with(SamplingParams(max_new_tokens=100, stop_token_ids=[9]))
    [out] = proc.process(encode(VerifyStep(0, ["r"], [[5, 9, 7, 8, 6]], [4])))
    # 2 tokens retained: one for the forward, one counted accepted, so the identity holds
    assert (out.spec_verify_ct, out.spec_accepted_tokens, out.spec_acceptance_histogram) == (
        1,
        1,
        [0, 1],
    )


def test_a_decode_step_without_drafts_is_a_verify_step():
    proc = proc_with(SamplingParams(max_new_tokens=100))
    proc.process(encode(VerifyStep(0, ["r"], [[5]], [0])))  # prefill
    proc.process(encode(VerifyStep(1, ["r"], [[6]], [0])))  # nothing drafted
    [out] = proc.process(encode(VerifyStep(2, ["r"], [[7, 8]], [3])))
    assert (out.spec_verify_ct, out.spec_accepted_tokens, out.spec_draft_tokens) == (2, 1, 3)
    assert out.spec_acceptance_histogram == [1, 1]


@settings(max_examples=80, deadline=None)
@given(
    windows=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=20),
    stop_at=st.one_of(st.none(), st.integers(0, 60)),
    max_new=st.integers(1, 60),
)
def test_completion_tokens_equal_one_plus_verify_ct_plus_accepted(windows, stop_at, max_new):
    """For any chunking, any stop-token truncation and any length cap, after a prefill."""
    proc = OutputProcessor(None, [EOS])
    proc.add_request("r", [1], SamplingParams(max_new_tokens=max_new, stop_token_ids=[9]))
    stream = [9 if i == stop_at else 7 for i in range(200)]
    outs = proc.process(encode(VerifyStep(0, ["r"], [[stream[0]]], [0])))
    total, drafted_kept, pos = len(outs[0].token_ids), 0, 1
    last = outs[0]
    for k, (n, extra) in enumerate(windows, start=1):
        if last.finished:
            break
        drafted = n - 1 + extra
        [last] = proc.process(encode(VerifyStep(k, ["r"], [stream[pos : pos + n]], [drafted])))
        total += len(last.token_ids)
        drafted_kept += drafted
        pos += n
    assert total == 1 + last.spec_verify_ct + last.spec_accepted_tokens
    assert last.spec_draft_tokens == drafted_kept
    assert sum(last.spec_acceptance_histogram) == last.spec_verify_ct


@settings(max_examples=60, deadline=None)
@given(
    windows=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=20),
    max_new=st.integers(1, 60),
)
def test_histogram_sums_match_verify_count_and_accepted_tokens(windows, max_new):
    proc = OutputProcessor(None, [EOS])
    proc.add_request("r", [1], SamplingParams(max_new_tokens=max_new))
    last = None
    pos = 0
    for k, (n, extra) in enumerate(windows):
        drafted = 0 if n == 1 and extra == 0 else n - 1 + extra
        outs = proc.process(encode(VerifyStep(k, ["r"], [[7] * n], [drafted])))
        if not outs:
            break
        last = outs[0]
        pos += len(last.token_ids)
    h = last.spec_acceptance_histogram
    assert sum(h) == last.spec_verify_ct
    assert sum(i * c for i, c in enumerate(h)) == last.spec_accepted_tokens
    assert last.spec_accepted_tokens <= pos


# -- drops, abort, requests ----------------------------------------------------------------------


def test_steps_for_finished_aborted_and_unknown_requests_are_dropped_and_counted():
    proc = OutputProcessor(TINY, [EOS])
    for rid in ("done", "gone", "live"):
        proc.add_request(rid, [1], SamplingParams(max_new_tokens=1 if rid == "done" else 50))
    step(proc, 0, {"done": (0, [5]), "live": (0, [5])})
    assert proc.abort("gone").finish_reason == "abort"
    outs = step(proc, 1, {"done": (1, [5]), "gone": (0, [5]), "who": (0, [5]), "live": (1, [6])})
    assert [o.rid for o in outs] == ["live"]
    assert (proc.dropped_steps, proc.dropped_unknown, proc.num_requests) == (3, 1, 1)


def test_a_replayed_or_stale_step_is_dropped_not_applied_twice():
    proc = proc_with(SamplingParams(max_new_tokens=50, logprobs=0))
    [first] = step(proc, 3, {"r": (0, [5, 6])})
    assert step(proc, 3, {"r": (0, [5, 6])}) == [] and step(proc, 2, {"r": (2, [7])}) == []
    [later] = step(proc, 4, {"r": (2, [7])})
    assert (first.token_ids, later.token_ids, later.logprobs) == ([5, 6], [7], [token_logprob(2, 7)])
    assert list(proc.get_state("r").output_ids) == [5, 6, 7] and proc.dropped_steps == 2


def test_finished_rids_are_remembered_only_up_to_a_bound():
    proc = OutputProcessor(None, [EOS], finished_memory=2)
    for k in range(5):
        proc.add_request(f"r{k}", [], SamplingParams(max_new_tokens=1))
        proc.process(encode(VerifyStep(k, [f"r{k}"], [[5]], [0])))
    assert len(proc._finished) == 2 and proc.num_requests == 0


def test_abort_settles_held_back_text_and_reports_the_retained_length():
    proc = proc_with(SamplingParams(max_new_tokens=50, stop=["STOP"], logprobs=1))
    [out] = step(proc, 0, {"r": (0, text_ids(TINY, "go ST"))})
    assert out.text == "go "
    end = proc.abort("r")
    assert (end.text, end.finish_reason, end.finished_len, end.token_ids) == ("ST", "abort", 5, [])
    assert end.logprobs == [] and end.top_logprobs == []
    assert proc.abort("r") is None and proc.abort("nobody") is None


def test_adding_a_running_rid_twice_is_an_error():
    proc = proc_with(SamplingParams())
    with pytest.raises(ValueError):
        proc.add_request("r", [], SamplingParams())


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="stop"):
        OutputProcessor(None).add_request("r", [], SamplingParams(stop=["x"]))


def test_without_a_tokenizer_deltas_carry_ids_and_no_text():
    proc = proc_with(SamplingParams(max_new_tokens=3), tokenizer=None)
    [out] = step(proc, 0, {"r": (0, [5, 6, 7, 8])})
    assert (out.token_ids, out.text, out.finish_reason) == ([5, 6, 7], "", "length")


def test_requests_in_one_step_finish_independently():
    proc = OutputProcessor(TINY, [EOS])
    proc.add_request("a", [], SamplingParams(max_new_tokens=50, stop=["c"]))
    proc.add_request("b", [], SamplingParams(max_new_tokens=2))
    proc.add_request("c", [], SamplingParams(max_new_tokens=50))
    w = text_ids(TINY, "abcd")
    outs = step(proc, 0, {"a": (0, w), "b": (0, w), "c": (0, w)})
    assert [(o.rid, o.text, o.finish_reason, o.finished_len) for o in outs] == [
        ("a", "ab", "stop", 3),
        ("b", "ab", "length", 2),
        ("c", "abcd", None, None),
    ]
    assert proc.num_requests == 1


# -- malformed steps change nothing --------------------------------------------------------------


def snapshot(proc: OutputProcessor):
    return (
        proc.dropped_steps,
        proc.num_requests,
        {
            rid: (
                st.output_ids.tolist(),
                st.status,
                st.finished_len,
                st.logprobs_sent,
                dataclasses.astuple(st.text),
                dataclasses.astuple(st.stats),
            )
            for rid, st in proc._requests.items()
        },
    )


def started_processor() -> OutputProcessor:
    proc = OutputProcessor(TINY, [EOS])
    proc.add_request("a", [], SamplingParams(max_new_tokens=50, stop=["STOP"], logprobs=2))
    proc.add_request("b", [], SamplingParams(max_new_tokens=50))
    step(proc, 0, {"a": (0, text_ids(TINY, "go ST")), "b": (0, text_ids(TINY, "x\xe4"))})
    return proc


def good_message() -> dict:
    w = text_ids(TINY, "OP")
    return msgpack.unpackb(encode(make_step(1, {"a": (5, w), "b": (3, [5])}, 2, 1)), raw=False)


BREAKS = [
    lambda m: m.update(v=9),
    lambda m: m.update(tok=i32(1, 2)),
    lambda m: m.update(tok=i32(-1, 2, 3)),
    lambda m: m.update(lp=np.array([math.nan, 0.0, 0.0]).tobytes()),
    lambda m: m.update(draft=i32(0, 0)),
    lambda m: m.update(extra=1),
    lambda m: m.update(len=i32(2)),
    lambda m: m.update(rids=["a", "a"]),
]


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_a_malformed_step_raises_protocol_error_and_changes_no_request(data):
    proc = started_processor()
    before = snapshot(proc)
    msg = good_message()
    for k in data.draw(st.lists(st.integers(0, len(BREAKS) - 1), min_size=1, max_size=3)):
        BREAKS[k](msg)
    payload = msgpack.packb(msg, use_bin_type=True)
    if data.draw(st.booleans()):  # and/or cut it short
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    with pytest.raises(ProtocolError):
        proc.process(payload)
    assert snapshot(proc) == before
    # ...and the processor still works: the good step applies afterwards.
    outs = proc.process(msgpack.packb(good_message(), use_bin_type=True))
    assert outs[0].finish_reason == "stop" and outs[0].matched_stop == "STOP"


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=120))
def test_random_bytes_raise_protocol_error_and_change_no_request(raw):
    proc = started_processor()
    before = snapshot(proc)
    with pytest.raises(ProtocolError):
        proc.process(raw)
    assert snapshot(proc) == before
