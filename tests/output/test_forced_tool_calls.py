"""Calls forced by the grammar (`tool_choice` required or named): announced once their name is
known, their arguments streamed as generated. Whatever the cuts and the parser's markup, each
call's arguments add up to its exact JSON text, and nothing is content."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from pipeline.output.forced_tool_calls import ForcedCallStream
from pipeline.output.tool_calls import ToolDelta

NAMES = ["get_weather", "search", 'we"ird\\name', "天気"]
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000)
    | st.text('ab{}[]:,"\\ é世', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text('ab{"}', min_size=1, max_size=4), inner, max_size=3), max_leaves=8)
ARGS = st.dictionaries(st.text("abc_", min_size=1, max_size=4), JSON_VALUE, max_size=3)
CALLS = st.lists(st.tuples(st.sampled_from(NAMES), ARGS, st.booleans()), min_size=1, max_size=3)
FORMATS = {  # start, between calls, end; the argument key
    "hermes": (("<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"), "arguments"),
    "llama3_json": (("", "; ", ""), "parameters"),
    "mistral": (("[TOOL_CALLS][", ", ", "]"), "arguments"),
}


def args_text(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def render(calls: list, fmt: str) -> str:
    (start, between, end), key = FORMATS[fmt]
    objs = []
    for name, args, args_first in calls:
        fields = [f'"name":{json.dumps(name, ensure_ascii=False)}', f'"{key}":{args_text(args)}']
        objs.append("{" + ",".join(fields[::-1] if args_first else fields) + "}")
    return start + between.join(objs) + end


def stream(pieces: list[str]) -> tuple[list[ToolDelta], dict[int, list]]:
    """Every delta, and each call as (id, name, its argument pieces)."""
    s = ForcedCallStream(new_id=lambda i: f"call_{i}")
    deltas = [s.feed(p) for p in pieces] + [s.finish()]
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.calls:
            assert c.index not in calls  # announced once
            calls[c.index] = [c.id, c.name, [c.arguments]]
        for index, text in d.args:
            calls[index][2].append(text)  # only after its announcement
    return deltas, calls


def cut(text: str, sizes: list[int]) -> list[str]:
    pieces, i = [], 0
    for n in sizes:
        pieces.append(text[i:i + n])
        i += n
    return [*pieces, text[i:]]


@given(CALLS, st.sampled_from(list(FORMATS)), st.lists(st.integers(1, 9), max_size=60))
def test_streamed_arguments_add_up_to_each_calls_exact_json(calls, fmt, sizes):
    text = render(calls, fmt)
    deltas, got = stream(cut(text, sizes))
    assert all(d.content == "" for d in deltas)
    assert [(cid, name, "".join(parts)) for cid, name, parts in got.values()] == [
        (f"call_{i}", name, args_text(args)) for i, (name, args, _) in enumerate(calls)]
    # one feed (the non-streamed answer) gives each call whole
    whole = ForcedCallStream(new_id=lambda i: f"call_{i}").feed(text)
    assert whole.args == [] and [(c.name, c.arguments) for c in whole.calls] == [
        (name, args_text(args)) for name, args, _ in calls]


@given(CALLS, st.sampled_from(list(FORMATS)), st.data())
def test_a_call_cut_off_keeps_a_prefix_of_its_arguments(calls, fmt, data):
    text = render(calls, fmt)
    stop = data.draw(st.integers(0, len(text)))
    _, got = stream(cut(text[:stop], data.draw(st.lists(st.integers(1, 9), max_size=30))))
    for i, (_, name, parts) in got.items():
        assert name == calls[i][0]
        assert args_text(calls[i][1]).startswith("".join(parts))


def test_a_long_argument_arrives_in_pieces_as_generated():
    text = render([("search", {"q": "x" * 40}, False)], "hermes")
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    deltas, got = stream(pieces)
    announced = next(i for i, d in enumerate(deltas) if d.calls)
    assert deltas[announced].calls[0].name == "search"
    assert sum(1 for d in deltas if d.args) >= 8  # not held until the call closes
    assert "".join(got[0][2]) == '{"q":"' + "x" * 40 + '"}'
