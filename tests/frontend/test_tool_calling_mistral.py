"""Tool calling with `tool_call_parser: mistral` on a Mistral-style chat template, through the
official `openai` client: the fake engine's scripted output for `auto` and `none`, and the tiny
engine for grammar-enforced `required` and named calls, streamed equal to non-streamed."""

from __future__ import annotations

import asyncio
import functools

import pytest
from support import tool_clients
from support.server_fakes import ByteTok, call
from support.tool_clients import USER, calls_of, fake
from support.tool_models import (
    MISTRAL_TEMPLATE,
    SEARCH,
    WEATHER,
    TemplateByteTok,
    TemplateTinyTok,
    mistral_output,
)

from pipeline.config import EngineConfig, load_config
from pipeline.engine.local import LocalEngineClient, build_local_engine
from pipeline.frontend.app import ServerSettings, create_app
from pipeline.frontend.tools import Tool, tool_grammar
from pipeline.grammar.llg import compile_grammar, grammar_matcher
from pipeline.tiny_tokenizer import ByteTokenizer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]
TWO = mistral_output("Let me check. ", [("get_weather", {"city": "Paris"}),
                                        ("search", {"q": "é [x]"})])
SETTINGS = ServerSettings(tool_call_parser="mistral")
both = functools.partial(tool_clients.both, parser="mistral")


@pytest.mark.parametrize("window", [1, 5])
def test_auto_parses_the_call_array_streamed_and_not(window):
    full, streamed = both(fake(TWO, window), TemplateByteTok(MISTRAL_TEMPLATE),
                          tools=[WEATHER, SEARCH])
    for done in (full, streamed):
        c = done.choices[0]
        assert (c.finish_reason, c.message.content) == ("tool_calls", "Let me check. ")
        assert calls_of(c.message) == [("get_weather", '{"city": "Paris"}'),
                                       ("search", '{"q": "é [x]"}')]


@pytest.mark.parametrize("kw", [{"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "none"},
                                {"tools": [SEARCH]}])
def test_text_none_and_unknown_calls_stay_content(kw):
    script = "It is sunny." if kw == {"tools": [WEATHER]} else TWO
    full, streamed = both(fake(script), TemplateByteTok(MISTRAL_TEMPLATE), **kw)
    for done in (full, streamed):
        c = done.choices[0]
        assert (c.finish_reason, c.message.content, c.message.tool_calls) == (
            "stop", script, None)


def test_multi_turn_renders_calls_and_results_in_the_mistral_template():
    engine = fake("Sunny.")
    history = [*USER, {"role": "assistant", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    full, _ = both(engine, TemplateByteTok(MISTRAL_TEMPLATE), messages=history, tools=[WEATHER])
    assert full.choices[0].message.content == "Sunny."
    prompt = ByteTok().decode(next(iter(engine.prompts.values())))
    assert '[/AVAILABLE_TOOLS][INST]Weather in Paris?[/INST]' in prompt
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>' in prompt
    assert '[TOOL_RESULTS]{"content": "21 C"}[/TOOL_RESULTS]' in prompt


def test_a_special_token_marker_is_kept_in_the_text_for_the_parser():
    class Special(TemplateByteTok):
        all_special_tokens = ("[TOOL_CALLS]",)

    engine = fake(TWO)
    for body, skip in (({"tools": [WEATHER]}, False), ({}, True)):
        r = asyncio.run(call(create_app(engine, Special(MISTRAL_TEMPLATE), SETTINGS), "POST",
                             "/v1/chat/completions", {"messages": USER, "max_tokens": 4, **body}))
        assert r.status_code == 200, r.text
        assert list(engine.requests.values())[-1].skip_special_tokens is skip


def test_the_parser_is_accepted_at_load():
    assert EngineConfig(model="tiny:1", tool_call_parser="mistral").tool_call_parser == "mistral"


@pytest.mark.parametrize("parallel", [None, False])
def test_the_required_grammar_takes_one_array_of_calls_and_more_only_when_parallel(parallel):
    tok = ByteTokenizer()
    req = type("Req", (), {"tools": [Tool.model_validate(t) for t in (WEATHER, SEARCH)],
                           "tool_choice": "required", "parallel_tool_calls": parallel})()
    grammar = compile_grammar("lark", tool_grammar(req, "mistral"), tok)
    # The grammar's JSON is spaced as json.dumps (and templates' tojson); calls joined by ", ".
    one = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    two = one[:-1] + ', {"name": "search", "arguments": {"q": "x"}}]'
    compact = '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris"}}]'
    for text, ok in ((one, True), (two, parallel is None), (" " + one, False), (compact, False)):
        m = grammar_matcher(grammar, tok)
        ids = tok.encode(text)
        assert (m.valid_prefix(ids) == len(ids)) is ok, text


def test_a_special_token_marker_is_the_token_in_the_grammar_not_its_text():
    tok = ByteTokenizer()
    req = type("Req", (), {"tools": [Tool.model_validate(WEATHER)], "tool_choice": "required",
                           "parallel_tool_calls": False})()
    grammar = compile_grammar("lark", tool_grammar(req, "mistral", {"[TOOL_CALLS]": 1}), tok)
    call = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    for ids, ok in (([1, *tok.encode(call)], True), (tok.encode("[TOOL_CALLS]" + call), False)):
        assert (grammar_matcher(grammar, tok).valid_prefix(ids) == len(ids)) is ok


def test_required_and_named_on_the_tiny_engine_are_parsed_mistral_calls():
    config = load_config("configs/tiny.yaml", {"attention_backend": "sdpa",
                                               "max_model_len": 2048})
    core = build_local_engine(config)
    q = {"type": "object", "additionalProperties": False, "required": ["q"],
         "properties": {"q": {"type": "string", "maxLength": 6}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": q}}
             for n in ("search", "lookup")]
    named = {"type": "function", "function": {"name": "lookup"}}
    done = []
    try:
        for choice, parallel in (("required", False), (named, None)):
            done.append(both(LocalEngineClient(core), TemplateTinyTok(MISTRAL_TEMPLATE),
                             model=config.served_name, tools=tools, tool_choice=choice,
                             temperature=1.0, seed=3, max_tokens=120,
                             **({} if parallel is None else {"parallel_tool_calls": parallel})))
    finally:
        asyncio.run(core.stop())
    for (full, streamed), one in zip(done, (True, False)):
        for c in (full.choices[0], streamed.choices[0]):
            assert (c.finish_reason, c.message.content) == ("tool_calls", None)
            names = [name for name, _ in calls_of(c.message)]
            assert names and set(names) <= ({"search", "lookup"} if one else {"lookup"})
            assert len(names) == 1 or not one
        assert calls_of(full.choices[0].message) == calls_of(streamed.choices[0].message)
