"""`required` and named `tool_choice` enforced by the grammar engine, on the in-process tiny
engine (random weights, so only the grammar makes its output a call): sampled at temperature 1.0,
every call parses and validates against the tool's schema (issue 59, must-show 3)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from support.tool_models import TemplateTinyTok

from pipeline.config import load_config
from pipeline.engine.local import LocalEngineClient, build_local_engine
from pipeline.frontend.app import ServerSettings, create_app

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

ARGS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 6},
                       "unit": {"enum": ["C", "F"]}, "days": {"type": "integer",
                                                              "minimum": 1, "maximum": 9}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": ARGS}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "additionalProperties": False,
    "properties": {"q": {"type": "string", "maxLength": 8}}}}}


def chat_many(requests: list[dict], chunks: list | None = None, **overrides) -> list:
    """Each request's completion; one with "stream": True reassembled by the SDK's helper (its
    chunks added to `chunks`)."""
    config = load_config("configs/tiny.yaml", {"attention_backend": "sdpa",
                                               "max_model_len": 2048, **overrides})
    core = build_local_engine(config)
    app = create_app(LocalEngineClient(core), TemplateTinyTok(),
                     ServerSettings(tool_call_parser="hermes"))

    async def go():
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test", timeout=240) as http:
                c = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http)
                done = []
                for kw in requests:
                    kw = {"model": config.served_name,
                          "messages": [{"role": "user", "content": "weather?"}], **kw}
                    if not kw.pop("stream", False):
                        done.append(await c.chat.completions.create(**kw))
                        continue
                    async with c.chat.completions.stream(**kw) as s:
                        got = [e.chunk async for e in s if e.type == "chunk"]
                        done.append(await s.get_final_completion())
                    if chunks is not None:
                        chunks.append(got)
                return done
        finally:
            await core.stop()
    return asyncio.run(go())


@pytest.mark.parametrize("n_required,n_named,n", [
    (1, 1, 4), pytest.param(7, 6, 16, marks=pytest.mark.slow)])  # slow: n >= 200, ~90 s
def test_required_and_named_calls_always_parse_and_validate_at_temperature_1(n_required,
                                                                            n_named, n):
    required = {"tools": [WEATHER, SEARCH], "tool_choice": "required", "n": n,
                "parallel_tool_calls": False, "temperature": 1.0, "max_tokens": 200}
    named = {**required, "tool_choice": {"type": "function",
                                         "function": {"name": "get_weather"}}}
    done = chat_many([{**required, "seed": s} for s in range(n_required)]
                     + [{**named, "seed": 100 + s} for s in range(n_named)])
    choices = [c for d in done for c in d.choices]
    assert len(choices) == (n_required + n_named) * n
    names = set()
    for i, c in enumerate(choices):
        assert c.finish_reason == "tool_calls", c.message.content
        assert c.message.content is None and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0].function
        names.add(call.name)
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), ARGS)
        else:
            assert i < n_required * n and isinstance(json.loads(call.arguments), dict)
    assert "get_weather" in names


def test_required_and_named_streamed_reassemble_to_the_non_streamed_call():
    base = {"tools": [WEATHER, SEARCH], "temperature": 1.0, "max_tokens": 200, "seed": 5}
    named = {"type": "function", "function": {"name": "search"}}
    kws = [{**base, "tool_choice": "required"}, {**base, "tool_choice": named}]
    chunks: list = []
    done = chat_many([*kws, *({**kw, "stream": True} for kw in kws)], chunks)
    got = [[(t.function.name, t.function.arguments) for t in d.choices[0].message.tool_calls]
           for d in done]
    assert got[:2] == got[2:]
    for stream in chunks:  # the arguments arrive as they are generated, the name once first
        deltas = [t for c in stream if c.choices for t in c.choices[0].delta.tool_calls or []]
        assert deltas[0].id and deltas[0].function.name
        assert all(d.id is None and d.function.name is None for d in deltas[1:])
        assert len(deltas) > 3
    assert all(d.choices[0].finish_reason == "tool_calls" for d in done)
    assert {name for name, _ in got[1]} == {"search"}


def test_greedy_tool_calls_are_the_same_with_and_without_speculation():
    kw = {"tools": [WEATHER, SEARCH], "temperature": 0.0, "max_tokens": 120}
    requests = [{**kw, "tool_choice": "required"}, {**kw, "tool_choice": "required",
                                                    "stream": True},
                {**kw, "tool_choice": {"type": "function", "function": {"name": "search"}}}]
    runs = [chat_many(requests, **o) for o in ({"draft": "none"}, {"draft": "model"},
                                               {"draft": "ngram"})]
    got = [[(d.choices[0].finish_reason, d.choices[0].message.content,
             [(t.function.name, t.function.arguments) for t in d.choices[0].message.tool_calls
              or []]) for d in run] for run in runs]
    assert got[0] == got[1] == got[2]
    assert [r[0] for r in got[0]] == ["tool_calls"] * 3, got[0]
    assert runs[1][0].choices[0].model_extra["spec_stats"]["accepted_tokens"] > 0
