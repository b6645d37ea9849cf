"""Chunking invariance and streaming (docs/contracts.md): every cut of a token stream into verify
steps gives the same final ids, text, logprobs, finish reason, matched stop and finished_len as one
token per step and as the naive whole-stream reference; the text deltas always add up to the final
text."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.output_support import (
    EOS,
    PIECES,
    PLAIN_ADDED,
    SP_PIECES,
    STOP,
    Collected,
    byte_id,
    feed,
    make_step,
    piece_id,
    reference,
    sentencepiece_tokenizer,
    tiny_tokenizer,
    token_logprob,
    token_top,
)

from pipeline.output.detokenizer import Detokenizer
from pipeline.output.processor import OutputProcessor
from pipeline.params import SamplingParams
from pipeline.protocol import encode
from pipeline.tiny_tokenizer import ByteTokenizer

TINY = tiny_tokenizer()
TINY_POOL = (
    [byte_id(b) for b in b"ab c.!"]
    + [byte_id(b) for b in "世🎉".encode()]  # every byte of a CJK char and an emoji, alone
    + [byte_id(0x80), byte_id(0xFF)]  # bytes that are never valid UTF-8
    + [piece_id(TINY, p) for p in PIECES]
    + [EOS, STOP, PLAIN_ADDED]
)
STOP_ALPHABET = ["a", "b", "c", " ", ".", "ab", "世", "🎉", "stop", "<x>", "<stop>", "\ufffd"]


def _decode_fn(detok: Detokenizer):
    return lambda ids, skip: detok.decode(list(ids), skip)


@st.composite
def scenarios(draw, pool: list[int], decode):
    stream = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=40))
    max_new = draw(st.one_of(st.just(len(stream)), st.integers(1, len(stream))))
    min_new = draw(st.one_of(st.just(0), st.integers(0, max_new)))
    skip = draw(st.booleans())
    text = decode(stream, skip)
    stops = []
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 2]))):
        if text and draw(st.booleans()):  # a piece of the actual text, so stops do match
            i = draw(st.integers(0, len(text) - 1))
            j = draw(st.integers(i + 1, min(len(text), i + 6)))
            stops.append(text[i:j])
        else:
            stops.append(draw(st.sampled_from(STOP_ALPHABET)))
    params = SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        stop=stops,
        stop_token_ids=draw(st.sampled_from([[], [STOP], [STOP, byte_id(ord("."))]])),
        ignore_eos=draw(st.booleans()),
        include_stop_str_in_output=draw(st.booleans()),
        skip_special_tokens=skip,
        logprobs=draw(st.sampled_from([None, 0, 1, 3, 5])),
    )
    cuts = draw(st.lists(st.integers(1, 8), min_size=1, max_size=6))
    return stream, params, cuts


def check_invariance(tokenizer, eos, stream, params, cuts, context_free=None) -> None:
    detok = Detokenizer(tokenizer, context_free=context_free)
    ref = reference(stream, params, _decode_fn(detok), set(eos), set(detok.special_ids),
                    detok.byte_tokens)
    runs = {}
    for name, c in {"one": [1], "cuts": cuts, "whole": [len(stream)]}.items():
        proc = OutputProcessor(tokenizer, eos)
        if context_free is not None:
            proc.detokenizer.context_free = context_free
        proc.add_request("r", [1, 2, 3], params)
        got = feed(proc, "r", stream, c)
        runs[name] = got
        # Streaming: every delta aligned, text deltas add up to the final text, nothing after finish.
        for o in got.outs:
            if params.logprobs is not None:
                assert len(o.logprobs) == len(o.token_ids)
            if params.logprobs:
                assert len(o.top_logprobs) == len(o.token_ids)
                assert all(len(t) == params.logprobs for t in o.top_logprobs)
        assert [o.finished for o in got.outs[:-1]] == [False] * (len(got.outs) - 1)
        assert proc.num_requests == (0 if got.last.finished else 1)
        if got.last.finished:  # a later step for the request is dropped, nothing leaks out
            late = make_step(99, {"r": (len(stream), stream[:3])})
            assert proc.process(encode(late)) == [] and proc.dropped_steps == 1
    final = runs["one"].final()
    for name, got in runs.items():
        assert got.final() == final, name
    ids, text, lps, top, reason, matched, flen = final
    assert (ids, text, reason, matched, flen) == (
        ref.ids,
        ref.text,
        ref.reason,
        ref.matched,
        ref.finished_len,
    )
    if params.logprobs is not None:
        assert lps == [token_logprob(p, t) for p, t in enumerate(ids)]
    if params.logprobs:
        assert top == [token_top(p, 5)[: params.logprobs] for p in range(len(ids))]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_cut_of_a_stream_gives_the_same_output_as_one_token_per_step(data):
    detok = Detokenizer(TINY)
    stream, params, cuts = data.draw(scenarios(TINY_POOL, _decode_fn(detok)))
    check_invariance(TINY, [EOS], stream, params, cuts)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_vllm_style_context_offsets_give_the_same_output(data):
    # The generic (prefix/read offsets) path, used for tokenizers whose decode needs context.
    detok = Detokenizer(TINY)
    stream, params, cuts = data.draw(scenarios(TINY_POOL, _decode_fn(detok)))
    check_invariance(TINY, [EOS], stream, params, cuts, context_free=False)


SP = sentencepiece_tokenizer()
SP_POOL = (
    [byte_id(b) for b in "世🎉".encode()]  # byte-fallback pieces of multibyte characters
    + [byte_id(0x80)]
    + [SP.token_to_id(p) for p in SP_PIECES]
    + [EOS, STOP, PLAIN_ADDED]
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_sentencepiece_style_decoder_every_cut_gives_the_same_output(data):
    # Leading-space stripping and one U+FFFD per byte token: the context-offset path.
    detok = Detokenizer(SP)
    assert not detok.context_free
    stream, params, cuts = data.draw(scenarios(SP_POOL, _decode_fn(detok)))
    check_invariance(SP, [EOS], stream, params, cuts)


@pytest.mark.parametrize("cuts", [[1], [2], [3, 1], [1, 3], [4]])
def test_a_byte_that_invalidates_a_byte_fallback_run_never_revokes_sent_text(cuts):
    # Byte fallback decodes a run of byte tokens as one unit: E4 B8 B8 is "丸", but E4 B8 B8 E4
    # is four U+FFFD. Sending "丸" after the third byte would leave the streamed text different
    # from the final decode (found by the property above), so a trailing byte run's text waits.
    stream = [byte_id(b) for b in b"\xe4\xb8\xb8\xe4"]
    check_invariance(SP, [EOS], stream, SamplingParams(max_new_tokens=4), cuts)
    proc = OutputProcessor(SP, [EOS])
    proc.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=4))
    got = feed(proc, "r", stream, cuts)
    assert "".join(o.text for o in got.outs) == "\ufffd" * 4
    assert all(o.text == "" for o in got.outs[:-1])


@pytest.mark.parametrize("cuts", [[1], [2], [4]])
def test_a_stop_string_in_a_byte_fallback_run_completes_when_the_run_ends(cuts):
    # "丸" is only final once a non-byte token follows (a further byte could undo it), so the
    # stop string completes at that token, whatever the window sizes.
    stream = [*(byte_id(b) for b in "丸".encode()), SP.token_to_id("\u2581a"), EOS]
    params = SamplingParams(max_new_tokens=8, stop=["丸"])
    check_invariance(SP, [EOS], stream, params, cuts)
    proc = OutputProcessor(SP, [EOS])
    proc.add_request("r", [1, 2, 3], params)
    got = feed(proc, "r", stream, cuts)
    assert got.final()[0] == stream[:4] and got.text == ""
    assert (got.last.finish_reason, got.last.matched_stop) == ("stop", "丸")


def test_a_byte_fallback_run_is_sent_when_a_non_byte_token_ends_it():
    world = [byte_id(b) for b in "世界".encode()]
    stream = [SP.token_to_id("\u2581a"), *world, SP.token_to_id("\u2581b")]
    proc = OutputProcessor(SP, [EOS])
    proc.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=len(stream) + 1))
    got = feed(proc, "r", stream, [1])
    assert [o.text for o in got.outs] == ["a", *[""] * len(world), "世界 b"]


@pytest.fixture(scope="module")
def smol_pool(smollm2_tokenizer) -> list[int]:
    tok = smollm2_tokenizer
    ids = tok.encode("Hello world. Stop here, stop! 世界 🎉 ok", add_special_tokens=False)
    return sorted(set(ids)) + [0, 1, 2]  # incl. partial-UTF-8 pieces of 世界/🎉 and specials


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_real_smollm2_tokenizer_every_cut_gives_the_same_output(smollm2_tokenizer, smol_pool, data):
    detok = Detokenizer(smollm2_tokenizer)
    stream, params, cuts = data.draw(scenarios(smol_pool, _decode_fn(detok)))
    check_invariance(smollm2_tokenizer, [2], stream, params, cuts)


def test_smollm2_pool_holds_partial_utf8_pieces(smollm2_tokenizer, smol_pool):
    # The property above is only meaningful if some pieces decode to an incomplete character.
    partial = [t for t in smol_pool if smollm2_tokenizer.decode([t]).endswith("\ufffd")]
    assert len(partial) >= 4


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_requests_batched_together_finish_as_they_would_alone(data):
    # Several requests in the same steps, with their own windows, params and start steps: the
    # batched path (shared stop-id mask, one decode call, per-request offsets) must not mix them.
    detok = Detokenizer(TINY)
    cases = [data.draw(scenarios(TINY_POOL, _decode_fn(detok))) for _ in range(3)]
    starts = [data.draw(st.integers(0, 3)) for _ in cases]
    alone = []
    for stream, params, _ in cases:
        proc = OutputProcessor(TINY, [EOS])
        proc.add_request("r", [], params)
        alone.append(feed(proc, "r", stream, [1]).final())

    proc = OutputProcessor(TINY, [EOS])
    pos = [0] * len(cases)
    got = [Collected() for _ in cases]
    done = [False] * len(cases)
    for k in range(200):
        windows = {}
        for j, ((stream, params, cuts), start) in enumerate(zip(cases, starts)):
            if k == start:
                proc.add_request(f"r{j}", [], params)
            if k < start or done[j] or pos[j] >= len(stream):
                continue
            size = cuts[k % len(cuts)]
            windows[f"r{j}"] = (pos[j], stream[pos[j] : pos[j] + size])
        if not windows and k > max(starts):
            break
        if windows:
            for out in proc.process(encode(make_step(k, windows))):
                j = int(out.rid[1:])
                got[j].outs.append(out)
                pos[j] += len(windows[out.rid][1])
                done[j] = out.finished
    assert [g.final() for g in got] == alone


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_python_tokenizer_without_rust_backend_every_cut_gives_the_same_output(data):
    # pipeline.tiny_tokenizer.ByteTokenizer (the tiny test models' tokenizer): no Rust backend,
    # so decoding goes through its batch_decode, with context offsets.
    tok = ByteTokenizer()
    detok = Detokenizer(tok)
    assert not detok.context_free and detok.special_ids == {0, 1, 2}
    pool = [ord(c) for c in "ab c.!"] + [0xE9, 0x80, 0, 1, 2]
    stream, params, cuts = data.draw(scenarios(pool, _decode_fn(detok)))
    check_invariance(tok, [2], stream, params, cuts)


# Chunks of a SentencePiece-style stream: whole characters as byte-fallback runs, lone bytes that
# extend a run into U+FFFDs, and non-byte pieces that end a run.
MARU = [byte_id(b) for b in "丸".encode()]
SP_CHUNKS = [MARU, MARU, [byte_id(0xE4)], [byte_id(0xB8)], [SP.token_to_id("\u2581a")],
             [SP.token_to_id("a")], [SP.token_to_id("\u2581b")], [EOS]]


@st.composite
def second_stop_hit_scenarios(draw):
    """A stop string that completes before `min_new_tokens` (rejected) and may complete again
    later, inside or at the end of a byte-fallback run whose text a later byte can undo."""
    chunks = draw(st.lists(st.sampled_from(SP_CHUNKS), min_size=2, max_size=10))
    stream = [*MARU, SP.token_to_id("\u2581a"), *(t for c in chunks for t in c)]
    params = SamplingParams(
        max_new_tokens=len(stream),
        min_new_tokens=draw(st.integers(1, len(stream))),
        stop=draw(st.sampled_from([["丸"], ["丸", "a丸"], ["丸a"], ["\ufffd"]])),
        include_stop_str_in_output=draw(st.booleans()),
        skip_special_tokens=draw(st.booleans()),
        logprobs=draw(st.sampled_from([None, 0])),
    )
    cuts = draw(st.lists(st.integers(1, 8), min_size=1, max_size=4))
    return stream, params, cuts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(second_stop_hit_scenarios())
def test_a_stop_hit_after_a_min_new_tokens_rejection_obeys_the_byte_fallback_rule(case):
    # The search that goes on past a rejected hit must look at committed text only: the text of a
    # trailing byte run is not committed (a later byte can turn it into U+FFFDs).
    stream, params, cuts = case
    check_invariance(SP, [EOS], stream, params, cuts)


def test_a_trailing_byte_run_after_a_rejected_stop_hit_does_not_stop_the_request():
    # 丸 ▁a 丸 | E4 ▁b, min_new_tokens 4: the first 丸 is too early; the second is a trailing byte
    # run at the end of the first window, and the next byte turns it into four U+FFFDs.
    stream = [*MARU, SP.token_to_id("\u2581a"), *MARU, byte_id(0xE4), SP.token_to_id("\u2581b")]
    params = SamplingParams(max_new_tokens=len(stream), min_new_tokens=4, stop=["丸"])
    check_invariance(SP, [EOS], stream, params, [7, 2])
    proc = OutputProcessor(SP, [EOS])
    proc.add_request("r", [1, 2, 3], params)
    got = feed(proc, "r", stream, [7, 2])
    assert got.last.finish_reason == "length" and got.text == "丸 a\ufffd\ufffd\ufffd\ufffd b"
