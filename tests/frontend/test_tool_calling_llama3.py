"""Tool calling with `tool_call_parser: llama3_json` on a Llama-3-style chat template, through the
official `openai` client: the fake engine's scripted output for `auto` and `none`, and the tiny
engine for a grammar-enforced `required` call (issue 59, must-show 1's second template)."""

from __future__ import annotations

import asyncio
import functools

import pytest
from support import tool_clients
from support.server_fakes import ByteTok
from support.tool_clients import USER, calls_of, fake
from support.tool_models import (
    LLAMA3_TEMPLATE,
    SEARCH,
    WEATHER,
    TemplateByteTok,
    TemplateTinyTok,
    llama3_output,
)

from pipeline.config import load_config
from pipeline.engine.local import LocalEngineClient, build_local_engine

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]
TWO = llama3_output([("get_weather", {"city": "Paris"}), ("search", {"q": "x"})], tag=True)
both = functools.partial(tool_clients.both, parser="llama3_json")


@pytest.mark.parametrize("script", [TWO, " " + TWO.removeprefix("<|python_tag|>")])
def test_auto_parses_parallel_json_calls_streamed_and_not(script):
    full, streamed = both(fake(script), TemplateByteTok(LLAMA3_TEMPLATE), tools=[WEATHER, SEARCH])
    for done in (full, streamed):
        c = done.choices[0]
        assert (c.finish_reason, c.message.content) == ("tool_calls", None)
        assert calls_of(c.message) == [("get_weather", '{"city": "Paris"}'),
                                       ("search", '{"q": "x"}')]


@pytest.mark.parametrize("kw", [{"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "none"}])
def test_text_answers_and_none_stay_content(kw):
    script = "It is sunny." if "tool_choice" not in kw else TWO
    full, streamed = both(fake(script), TemplateByteTok(LLAMA3_TEMPLATE), **kw)
    for done in (full, streamed):
        c = done.choices[0]
        assert (c.finish_reason, c.message.content, c.message.tool_calls) == (
            "stop", script, None)


def test_multi_turn_renders_calls_and_results_in_the_llama3_template():
    engine = fake("Sunny.")
    history = [*USER, {"role": "assistant", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    full, _ = both(engine, TemplateByteTok(LLAMA3_TEMPLATE), messages=history, tools=[WEATHER])
    assert full.choices[0].message.content == "Sunny."
    prompt = ByteTok().decode(next(iter(engine.prompts.values())))
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n21 C<|eot_id|>" in prompt


def test_required_on_the_tiny_engine_is_a_parsed_llama3_call():
    config = load_config("configs/tiny.yaml", {"attention_backend": "sdpa",
                                               "max_model_len": 2048})
    core = build_local_engine(config)
    tool = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["q"],
        "properties": {"q": {"type": "string", "maxLength": 6}}}}}
    try:
        full, streamed = both(LocalEngineClient(core), TemplateTinyTok(LLAMA3_TEMPLATE),
                              model=config.served_name, tools=[tool], tool_choice="required",
                              parallel_tool_calls=False, temperature=1.0, seed=3, max_tokens=100)
    finally:
        asyncio.run(core.stop())
    for done in (full, streamed):
        c = done.choices[0]
        assert (c.finish_reason, c.message.content) == ("tool_calls", None)
        assert [name for name, _ in calls_of(c.message)] == ["search"]
    assert calls_of(full.choices[0].message) == calls_of(streamed.choices[0].message)
