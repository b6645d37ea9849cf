"""pipeline.output.detokenizer (batch decoding) and pipeline.output.text (stop-string search and
hold-back, bounded decode windows)."""

from __future__ import annotations

from support.output_support import (
    EOS,
    PLAIN_ADDED,
    STOP,
    byte_id,
    piece_id,
    text_ids,
    tiny_tokenizer,
)

from pipeline.output.detokenizer import Detokenizer
from pipeline.output.processor import OutputProcessor
from pipeline.output.text import StopStrings
from pipeline.params import SamplingParams
from pipeline.protocol import VerifyStep, encode

TINY = tiny_tokenizer()


def test_find_returns_the_occurrence_that_ends_first():
    stops = StopStrings.build(["cd", "abcde"])
    assert stops.find("xxabcdexx", 0) == (4, 6, "cd")


def test_find_prefers_the_longest_of_matches_ending_together():
    stops = StopStrings.build(["b", "ab"])
    assert stops.find("xab", 0) == (1, 3, "ab")


def test_find_only_reports_matches_ending_after_min_end():
    stops = StopStrings.build(["ab"])
    assert stops.find("ab..ab", 2) == (4, 6, "ab")
    assert stops.find("ab..", 2) is None
    assert stops.find("xab", 2) == (1, 3, "ab")  # starts before min_end, ends after it


def test_held_len_is_the_longest_suffix_that_starts_a_stop_string():
    stops = StopStrings.build(["STOP", "<|END|>"])
    assert stops.held_len("hello ST") == 2
    assert stops.held_len("hello <|EN") == 4
    assert stops.held_len("hello S") == 1
    assert stops.held_len("hello") == 0
    assert stops.held_len("STOP") == 0  # a whole stop string is a match, not a prefix


def test_held_len_of_single_character_stops_is_zero():
    assert StopStrings.build(["x", "y"]).held_len("abcx") == 0


def test_no_stop_strings_builds_nothing():
    assert StopStrings.build([]) is None


def test_decode_batch_matches_the_tokenizer_with_mixed_skip_flags(smollm2_tokenizer):
    detok = Detokenizer(smollm2_tokenizer)
    seqs = [smollm2_tokenizer.encode("Hello 世界", add_special_tokens=False) + [2], [1, 9906], []]
    skips = [True, False, True]
    expected = [smollm2_tokenizer.decode(s, skip_special_tokens=k) for s, k in zip(seqs, skips)]
    assert detok.decode_batch(seqs, skips) == expected


def test_smollm2_is_byte_level_with_special_chat_tokens(smollm2_tokenizer):
    detok = Detokenizer(smollm2_tokenizer)
    assert detok.context_free
    assert {0, 1, 2} <= detok.special_ids


def test_tiny_tokenizer_special_ids_exclude_plain_added_tokens():
    detok = Detokenizer(TINY)
    assert EOS in detok.special_ids and STOP in detok.special_ids
    assert PLAIN_ADDED not in detok.special_ids


def test_decode_window_stays_short_however_long_the_output():
    # The per-step decode covers the tokens since the last clean boundary, not the whole output.
    proc = OutputProcessor(TINY, [EOS])
    proc.add_request("r", [], SamplingParams(max_new_tokens=100_000, stop=["zz"]))
    stream = text_ids(TINY, "héllo wörld ") * 400  # includes 2-byte characters split over tokens
    sent = 0
    for k in range(0, len(stream), 3):
        sent += len(proc.process(encode(VerifyStep(k, ["r"], [stream[k : k + 3]], [2])))[0].text)
        st = proc.get_state("r")
        assert len(st.output_ids) - st.text.prefix_offset <= 3
        assert len(st.text.tail) <= 1
    assert sent == len("héllo wörld ") * 400


def test_incomplete_character_is_held_until_its_last_byte_arrives():
    proc = OutputProcessor(TINY, [EOS])
    proc.add_request("r", [], SamplingParams(max_new_tokens=10))
    b = "世".encode()
    texts = []
    for k, t in enumerate([byte_id(ord("a")), byte_id(b[0]), byte_id(b[1]), byte_id(b[2])]):
        texts.append(proc.process(encode(VerifyStep(k, ["r"], [[t]], [0])))[0].text)
    assert texts == ["a", "", "", "世"]


def test_piece_with_a_complete_char_then_a_partial_one_releases_the_complete_part():
    proc = OutputProcessor(TINY, [EOS])
    proc.add_request("r", [], SamplingParams(max_new_tokens=10))
    out = proc.process(encode(VerifyStep(0, ["r"], [[piece_id(TINY, b"a\xe4")]], [0])))
    assert out[0].text == "a"


def test_one_step_is_one_batch_decode_call_per_skip_flag(monkeypatch):
    proc = OutputProcessor(TINY, [EOS])
    for k in range(40):
        skip = k % 2 == 0
        proc.add_request(f"r{k}", [], SamplingParams(max_new_tokens=50, skip_special_tokens=skip))
    calls = []
    real = proc.detokenizer._decode_batch
    monkeypatch.setattr(
        proc.detokenizer, "_decode_batch", lambda seqs, skip: calls.append(skip) or real(seqs, skip)
    )
    w = text_ids(TINY, "abc")
    outs = proc.process(encode(VerifyStep(0, [f"r{k}" for k in range(40)], [w] * 40, [2] * 40)))
    assert [o.text for o in outs] == ["abc"] * 40
    assert sorted(calls) == [False, True]
