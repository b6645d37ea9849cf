"""Tool calling through the official `openai` client (issue 59, must-show 1 for `none` and `auto`):
the app in-process over the fake engine, whose scripted output holds Hermes tool calls, on a byte
tokenizer with a Hermes / Qwen2.5-style chat template."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from support.server_fakes import ByteTok, FakeEngine, call, check_openai_error
from support.tool_models import PLAIN_TEMPLATE, SEARCH, WEATHER, TemplateByteTok, hermes_output

from pipeline.config import EngineConfig
from pipeline.frontend.app import ServerSettings, create_app

pytestmark = pytest.mark.timeout(60)
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Weather in Paris?"}]
ONE_CALL = hermes_output("Let me check. ", [("get_weather", {"city": "Paris"})])
TWO_CALLS = hermes_output("", [("get_weather", {"city": "Paris"}), ("search", {"q": "é <x>"})])


def engine_for(script: str, window: int = 3) -> FakeEngine:
    return FakeEngine(script=script, eos_after=len(script.encode()), window=window,
                      max_model_len=4096)


def app_for(engine: FakeEngine, tok=None, parser: str = "hermes"):
    return create_app(engine, tok or TemplateByteTok(), ServerSettings(tool_call_parser=parser))


def client(app) -> tuple[httpx.AsyncClient, openai.AsyncOpenAI]:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return http, openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http)


def both(script: str, window: int = 3, **kw):
    """The non-streamed completion and the streamed one reassembled by the SDK's helper."""
    async def go():
        http, c = client(app_for(engine_for(script, window)))
        async with http:
            full = await c.chat.completions.create(model="fake-model", messages=USER, **kw)
            async with c.chat.completions.stream(model="fake-model", messages=USER, **kw) as s:
                chunks = [e.chunk async for e in s if e.type == "chunk"]
                streamed = await s.get_final_completion()
            return full, streamed, chunks
    return asyncio.run(go())


def calls_of(message) -> list[tuple[str, str]]:
    return [(t.function.name, t.function.arguments) for t in message.tool_calls or []]


@pytest.mark.parametrize("window", [1, 3, 7])
def test_auto_returns_the_call_and_streamed_reassembles_to_the_same(window):
    full, streamed, chunks = both(ONE_CALL, window, tools=[WEATHER])
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    assert calls_of(choice.message) == [("get_weather", '{"city": "Paris"}')]
    assert choice.message.tool_calls[0].id.startswith("call_")
    s = streamed.choices[0]
    assert (s.finish_reason, s.message.content, calls_of(s.message)) == (
        "tool_calls", choice.message.content, calls_of(choice.message))
    # Every token is counted, the markup's included.
    assert full.usage.completion_tokens == len(ONE_CALL.encode()) + 1
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta]
    assert all("<" not in (x or "") for x in contents)
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]


def test_parallel_calls_get_indexes_and_content_is_null():
    full, streamed, chunks = both(TWO_CALLS, 2, tools=[WEATHER, SEARCH])
    m = full.choices[0].message
    assert m.content is None
    assert calls_of(m) == [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "é <x>"}')]
    assert calls_of(streamed.choices[0].message) == calls_of(m)
    assert streamed.choices[0].message.content is None
    ids = [t.id for t in m.tool_calls]
    assert len(set(ids)) == 2
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0, 1]


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    full, streamed, chunks = both(TWO_CALLS, 2, tools=[WEATHER, SEARCH],
                                  parallel_tool_calls=False)
    for done in (full, streamed):
        c = done.choices[0]
        assert (c.finish_reason, c.message.content, calls_of(c.message)) == (
            "tool_calls", None, [("get_weather", '{"city": "Paris"}')])
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0]


def test_none_leaves_the_output_as_content():
    full, streamed, _ = both(ONE_CALL, tools=[WEATHER], tool_choice="none")
    for done in (full, streamed):
        c = done.choices[0]
        assert (c.finish_reason, c.message.content, c.message.tool_calls) == (
            "stop", ONE_CALL, None)


def test_a_call_of_an_unknown_function_or_broken_json_ends_as_content():
    broken = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'
    for script in (hermes_output("", [("rm_rf", {})]), broken):
        full, streamed, _ = both(script, tools=[WEATHER])
        for done in (full, streamed):
            c = done.choices[0]
            assert (c.finish_reason, c.message.content, c.message.tool_calls) == (
                "stop", script, None)


def test_without_tools_the_output_is_plain_content():
    full, streamed, _ = both(ONE_CALL)
    assert full.choices[0].message.content == streamed.choices[0].message.content == ONE_CALL


def test_multi_turn_call_result_answer_renders_through_the_template():
    engine = engine_for("It is sunny in Paris.")
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]

    async def go():
        http, c = client(app_for(engine))
        async with http:
            return await c.chat.completions.create(model="fake-model", messages=history,
                                                   tools=[WEATHER])
    done = asyncio.run(go())
    assert done.choices[0].message.content == "It is sunny in Paris."
    assert done.choices[0].finish_reason == "stop"
    prompt = ByteTok().decode(next(iter(engine.prompts.values())))
    assert '"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '{"type": "function", "function": {"name": "get_weather"' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def post(body: dict, tok=None, parser: str = "hermes") -> httpx.Response:
    return asyncio.run(call(app_for(engine_for("ok"), tok, parser), "POST", CHAT,
                            {"messages": USER, "max_tokens": 4, **body}))


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "messages": [*USER, {"role": "tool", "content": "x"}]},
     "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": '{"a": "\ud800"}'}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "\udc00"}}]},
     "tools"),
    ({"tools": [WEATHER], "tool_choice": "auto", "stop": None,
      "messages": [*USER, {"role": "user", "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "f",
                                                                         "arguments": "{}"}}]}]},
     "messages[1].tool_calls"),
])
def test_bad_tool_requests_are_a_400_naming_the_parameter(body, param):
    r = post(body)
    assert r.status_code == 400, r.text
    assert check_openai_error(r)["param"] == param


@pytest.mark.parametrize(("name", "pointer"), [("functions", "use tools"),
                                               ("function_call", "use tool_choice")])
def test_legacy_functions_stay_a_400_pointing_to_tools(name, pointer):
    r = post({name: [{"name": "f"}] if name == "functions" else "auto"})
    err = check_openai_error(r)
    assert (r.status_code, err["param"], err["code"]) == (400, name, "unsupported_parameter")
    assert pointer in err["message"]


def test_a_template_without_tool_support_is_a_400_naming_it():
    r = post({"tools": [WEATHER]}, tok=TemplateByteTok(PLAIN_TEMPLATE))
    err = check_openai_error(r)
    assert (r.status_code, err["param"]) == (400, "tools")
    assert "chat template does not support tools" in err["message"]


def test_with_the_parser_off_tools_are_refused_as_before():
    r = post({"tools": [WEATHER]}, parser="none")
    err = check_openai_error(r)
    assert (r.status_code, err["param"], err["code"]) == (400, "tools", "unsupported_parameter")
    assert "tool_call_parser" in err["message"]


def test_special_token_text_in_tool_schemas_is_refused_when_split():
    class Special(TemplateByteTok):
        all_special_tokens = ("<|im_end|>",)
    tool = {"type": "function", "function": {"name": "f", "description": "a<|im_end|>b"}}
    r = post({"tools": [tool]}, tok=Special())
    assert (r.status_code, check_openai_error(r)["param"]) == (400, "tools")
    assert post({"tools": [tool], "split_special_tokens": False}, tok=Special()).status_code == 200


def test_tool_call_parser_is_validated_at_load():
    with pytest.raises(ValueError, match="tool_call_parser"):
        EngineConfig(model="tiny:1", tool_call_parser="pythonic")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerSettings(tool_call_parser="pythonic")
    assert EngineConfig(model="tiny:1", tool_call_parser="hermes").tool_call_parser == "hermes"


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_a_parser_whose_format_the_template_never_writes_is_refused_at_load(parser):
    with pytest.raises(ValueError, match=f"tool_call_parser: '{parser}'"):
        app_for(engine_for(ONE_CALL), parser=parser)  # a Hermes template
    app_for(engine_for(ONE_CALL), TemplateByteTok(PLAIN_TEMPLATE), parser)  # no tools: a warning


def test_special_token_markers_are_kept_in_the_text_for_the_parser():
    class Special(TemplateByteTok):
        all_special_tokens = ("<tool_call>", "</tool_call>")

    engine = engine_for(ONE_CALL)
    for body, skip in (({"tools": [WEATHER]}, False), ({}, True),
                       ({"tools": [WEATHER], "tool_choice": "none"}, True)):
        r = asyncio.run(call(app_for(engine, Special()), "POST", CHAT,
                             {"messages": USER, "max_tokens": 4, **body}))
        assert r.status_code == 200, r.text
        assert list(engine.requests.values())[-1].skip_special_tokens is skip
