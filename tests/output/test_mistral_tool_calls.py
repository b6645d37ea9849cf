"""Mistral tool calls (pipeline.output.mistral_tool_calls): `[TOOL_CALLS]` then a JSON array,
held until the array closes; whatever the accepted windows, the streamed content and calls equal
the whole-text parse, and the marker never reaches `content` of a parsed call."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from support.output_support import (
    tiny_tokenizer,
    tool_calls_through_output_stage,
)

from pipeline.output.mistral_tool_calls import TOOL_CALLS, MistralStream
from pipeline.output.tool_calls import ToolDelta

TINY = tiny_tokenizer()
NAMES = ["get_weather", "search", "f"]

# Content may hold marker look-alikes (`[`, `[TOOL`, `CALLS]`) but never a full marker.
CONTENT = st.lists(st.sampled_from(["a", " ", "\n", "[", "[TOOL", "[TOOL_CALLS", "CALLS]", "]",
                                    "世", "é", "{", "}", '"', "x y"]), max_size=12).map(
    "".join).filter(lambda s: TOOL_CALLS not in s and not s.endswith(tuple(
        TOOL_CALLS[:k] for k in range(1, len(TOOL_CALLS)))))
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text("ab[]{}\"\\ é世", max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text("abc_", min_size=1, max_size=4), inner, max_size=3), max_leaves=8)
CALL = st.tuples(st.sampled_from(NAMES),
                 st.dictionaries(st.text("abcxyz_", min_size=1, max_size=5), JSON_VALUE,
                                 max_size=3))


def parse(text: str, names: list[str] | None = NAMES) -> ToolDelta:
    p = MistralStream(names)
    out = p.feed(text)
    out.add(p.finish())
    return out


def render(content: str, calls: list, pad: str, gap: str) -> str:
    return content + TOOL_CALLS + pad + json.dumps(
        [{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False) + gap


@settings(max_examples=300, deadline=None)
@given(content=CONTENT, calls=st.lists(CALL, min_size=1, max_size=3),
       pad=st.sampled_from(["", " ", "\n"]), gap=st.sampled_from(["", "\n", " "]),
       cuts=st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_streamed_tool_calls_equal_the_whole_text_parse_for_any_windows(content, calls, pad, gap,
                                                                        cuts):
    text = render(content, calls, pad, gap)
    streamed, pieces = tool_calls_through_output_stage(TINY, MistralStream(NAMES), text, cuts)
    whole = parse(text)
    assert streamed == whole
    assert whole.content == content  # nothing of the calls, not even whitespace after them
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert [c.index for c in whole.calls] == list(range(len(calls)))
    assert "".join(pieces) == content  # each delta's content, the marker never in it


@settings(max_examples=300, deadline=None)
@given(text=st.text("[TOOL_CALS]{}\"\\name:arguments f,", max_size=60),
       cuts=st.lists(st.integers(1, 7), min_size=1, max_size=6))
def test_any_text_cut_anywhere_parses_the_same_and_loses_nothing(text, cuts):
    p, total, at, k = MistralStream(), ToolDelta(), 0, 0
    while at < len(text):
        total.add(p.feed(text[at:at + cuts[k % len(cuts)]]))
        at, k = at + cuts[k % len(cuts)], k + 1
    total.add(p.finish())
    assert total == parse(text, None)
    if not total.calls:
        assert total.content == text


def test_content_before_the_marker_is_sent_at_once_and_only_a_partial_marker_waits():
    p = MistralStream(NAMES)
    assert p.feed("Let me check. [TOOL").content == "Let me check. "
    assert p.feed("_CALLS] [{\"name\": \"f\", ").content == ""
    assert p.feed("\"arguments\": {\"city\": \"]\\\"[\"}}").content == ""
    d = p.feed(', {"name": "search", "arguments": {}}]')
    assert [k.openai() for k in d.calls] == [
        {"id": "call_0", "type": "function",
         "function": {"name": "f", "arguments": '{"city": "]\\"["}'}},
        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]
    assert p.finish() == ToolDelta()
    assert p.content == "Let me check. "
    q = MistralStream(NAMES)
    assert q.feed("a [TOOL").content == "a "
    assert q.feed("S] b").content == "[TOOLS] b"


def test_a_bad_array_or_element_or_an_unclosed_one_is_content_with_its_marker():
    for text in (TOOL_CALLS + '[{"name": "f", "arguments": {"a": }}]',
                 TOOL_CALLS + '[{"name": "rm", "arguments": {}}]',
                 TOOL_CALLS + '[{"name": "f", "arguments": {}}, {"name": "f", "x": 1}]',
                 TOOL_CALLS + '[{"name": "f", "arguments": [1]}]',
                 TOOL_CALLS + '[{"name": "f", "arguments": {"x": NaN}}]',
                 TOOL_CALLS + '[]',
                 TOOL_CALLS + '{"name": "f", "arguments": {}}',
                 "hi " + TOOL_CALLS + '[{"name": "f", "arguments": {"a": "]'):
        assert parse(text) == ToolDelta(text, []), text
    good = TOOL_CALLS + '[{"name": "f", "arguments": {}}]'
    bad = TOOL_CALLS + '[{"name": "rm"}]'
    out = parse(good + " then text " + bad)
    assert [c.name for c in out.calls] == ["f"]
    assert out.content == " then text " + bad


def test_a_long_array_in_many_small_deltas_is_one_call():
    arg = "x" * 200_000
    p = MistralStream(NAMES)
    p.feed(TOOL_CALLS + '[{"name": "f", "arguments": {"a": "')
    for _ in range(0, len(arg), 7):
        assert p.feed(arg[:7]) == ToolDelta()
    d = p.feed('"}}]')
    assert len(json.loads(d.calls[0].arguments)["a"]) == len(range(0, len(arg), 7)) * 7
