"""Hermes tool calls parsed from the output stage's text deltas (pipeline.output.tool_calls):
whatever the accepted windows, the streamed content and calls equal the whole-text parse, and no
marker byte reaches `content` (issue 59, must-show 2)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from support.output_support import (
    tiny_tokenizer,
    tool_calls_through_output_stage,
)

from pipeline.output.tool_calls import END, START, HermesStream, ToolDelta, parse_tool_calls

TINY = tiny_tokenizer()
NAMES = ["get_weather", "search", "f"]

# Content may hold marker look-alikes (`<`, `<tool`, `</tool_call>`-ish) but never a full start.
CONTENT = st.lists(st.sampled_from(["a", " ", "\n", "<", "<tool", "<tool_call", "tool_call>",
                                    "世", "é", "{", "}", '"', "x y"]), max_size=12).map(
    "".join).filter(lambda s: START not in s and not s.endswith(tuple(
        START[:k] for k in range(1, len(START)))))
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text("ab<>/\"\\ é世", max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text("abc_", min_size=1, max_size=4), inner, max_size=3), max_leaves=8)
CALL = st.tuples(st.sampled_from(NAMES),
                 st.dictionaries(st.text("abcxyz_", min_size=1, max_size=5), JSON_VALUE,
                                 max_size=3),
                 st.sampled_from(["", "\n", " "]),  # inside the markers
                 st.sampled_from(["", "\n", "\n\n", " "]))  # after the call


def render(content: str, calls: list) -> str:
    text = content
    for name, args, pad, gap in calls:
        text += START + pad + json.dumps({"name": name, "arguments": args}) + pad + END + gap
    return text


@settings(max_examples=300, deadline=None)
@given(content=CONTENT, calls=st.lists(CALL, max_size=3),
       cuts=st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_streamed_tool_calls_equal_the_whole_text_parse_for_any_windows(content, calls, cuts):
    text = render(content, calls)
    streamed, pieces = tool_calls_through_output_stage(TINY, HermesStream(NAMES), text, cuts)
    whole = parse_tool_calls(text, NAMES)
    assert streamed == whole
    assert whole.content == content  # nothing of the calls, not even whitespace between them
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        (name, args) for name, args, _, _ in calls]
    assert [c.index for c in whole.calls] == list(range(len(calls)))
    assert "".join(pieces) == content  # each delta's content, markup never in it


@settings(max_examples=200, deadline=None)
@given(text=st.text("<tool_cal>/{}\"name:arguments ", max_size=60),
       cuts=st.lists(st.integers(1, 7), min_size=1, max_size=6))
def test_any_text_cut_anywhere_parses_the_same_and_loses_nothing(text, cuts):
    parser, total, at = HermesStream(), ToolDelta(), 0
    for k in range(len(text) + 1):
        size = cuts[k % len(cuts)]
        total.add(parser.feed(text[at:at + size]))
        at += size
        if at >= len(text):
            break
    total.add(parser.finish())
    assert total == parse_tool_calls(text)
    if START not in text:
        assert total == ToolDelta(text, [])


def test_content_before_a_call_is_sent_at_once_and_only_a_partial_marker_waits():
    p = HermesStream()
    assert p.feed("Let me check. <to").content == "Let me check. "
    assert p.feed("ol_call>{\"name\": \"f\", ").content == ""
    d = p.feed("\"arguments\": {\"city\": \"Paris\"}}</tool_call>")
    assert d.calls[0].openai() == {"id": "call_0", "type": "function", "function": {
        "name": "f", "arguments": '{"city": "Paris"}'}}
    assert p.finish() == ToolDelta()
    assert p.content == "Let me check. "


def test_a_partial_marker_that_is_not_one_is_released():
    p = HermesStream()
    assert p.feed("a <tool").content == "a "
    assert p.feed("s b").content == "<tools b"


def test_parallel_calls_and_whitespace_between_them():
    text = render("", [("f", {"a": 1}, "\n", "\n"), ("g", {}, "", "\n")])
    out = parse_tool_calls(text)
    assert out.content == ""
    assert [(c.index, c.name, c.arguments) for c in out.calls] == [(0, "f", '{"a": 1}'),
                                                                   (1, "g", "{}")]


def test_an_unparsable_or_unknown_or_unclosed_call_ends_as_content_honestly():
    broken = START + '{"name": "f", "arguments": {"a": }' + END
    assert parse_tool_calls(broken) == ToolDelta(broken, [])
    unknown = START + '{"name": "rm", "arguments": {}}' + END
    assert parse_tool_calls(unknown, NAMES) == ToolDelta(unknown, [])
    unclosed = "hi " + START + '{"name": "f", "arguments": {"a": 1'
    assert parse_tool_calls(unclosed) == ToolDelta(unclosed, [])
    not_json = START + '{"name": "f", "arguments": {"x": NaN}}' + END
    assert parse_tool_calls(not_json).calls == []
    good = render("", [("f", {}, "", "")])
    out = parse_tool_calls(good + " then text " + broken)
    assert [c.name for c in out.calls] == ["f"]
    assert out.content == " then text " + broken
