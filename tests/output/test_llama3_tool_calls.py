"""Llama 3.x JSON tool calls (pipeline.output.llama3_tool_calls): held whole when the output
starts like a call, content from the first character that cannot start one; the streamed
result equals the whole-text parse however the text is cut."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.output.llama3_tool_calls import PYTHON_TAG, Llama3JsonStream
from pipeline.output.tool_calls import ToolDelta

NAMES = ["get_weather", "search"]


def parse(text: str) -> ToolDelta:
    p = Llama3JsonStream(NAMES)
    out = p.feed(text)
    out.add(p.finish())
    return out


def streamed(text: str, cuts: list[int]) -> tuple[ToolDelta, list[str]]:
    p, total, pieces, at, k = Llama3JsonStream(NAMES), ToolDelta(), [], 0, 0
    while at < len(text):
        d = p.feed(text[at:at + cuts[k % len(cuts)]])
        at, k = at + cuts[k % len(cuts)], k + 1
        pieces.append(d.content)
        total.add(d)
    d = p.finish()
    pieces.append(d.content)
    total.add(d)
    return total, pieces


CALL = st.tuples(st.sampled_from(NAMES), st.dictionaries(
    st.text("abc", min_size=1, max_size=3), st.integers() | st.text("a;{}\" ", max_size=5),
    max_size=3))


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(CALL, min_size=1, max_size=3), tag=st.booleans(),
       lead=st.sampled_from(["", " ", "\n"]), cuts=st.lists(st.integers(1, 9), min_size=1))
def test_calls_cut_anywhere_parse_like_the_whole_text(calls, tag, lead, cuts):
    text = lead + (PYTHON_TAG if tag else "") + "; ".join(
        json.dumps({"name": n, "parameters": a}) for n, a in calls)
    got, pieces = streamed(text, cuts)
    assert got == parse(text)
    assert got.content == "" and not any(pieces)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls


@settings(max_examples=200, deadline=None)
@given(text=st.text("{}<|python_tag>\"name:; ab\n", max_size=40),
       cuts=st.lists(st.integers(1, 9), min_size=1))
def test_any_text_cut_anywhere_parses_the_same_and_loses_nothing(text, cuts):
    got, _ = streamed(text, cuts)
    assert got == parse(text)
    if not got.calls:
        assert got.content == text


def test_content_streams_from_the_first_character_that_cannot_start_a_call():
    p = Llama3JsonStream(NAMES)
    assert p.feed(" ").content == ""
    assert p.feed("<|py").content == ""
    assert p.feed("x").content == " <|pyx"
    assert p.feed("{more}").content == "{more}"


def test_broken_or_unknown_calls_are_content():
    for text in ('{"name": "get_weather", "parameters": {"city": }',
                 '{"name": "rm", "parameters": {}}',
                 '{"name": "search", "parameters": {}} trailing',
                 '{"a": 1}'):
        assert parse(text) == ToolDelta(text, [])
