"""Prefix caching end to end through the OpenAI API (the HTTP app over the in-process tiny engine,
no Ray): an agent-style conversation re-sending its history reuses the previous turn's KV
(`usage.prompt_tokens_details.cached_tokens`), answers exactly as without the cache, streamed
usage says so on both endpoints, and the request span carries `request.cached_tokens`.

The timing half of the issue's must-show 1 (TTFT with / without the cache) is
scripts/bench_prefix_cache.py; nothing here measures time."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import string

import httpx
import pytest
from support.paths import ROOT

from pipeline.config import load_config
from pipeline.engine.local import LocalEngineClient, build_local_engine
from pipeline.frontend.app import ServerSettings, create_app

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"
TURNS = 6


def _engine(overrides: dict):
    config = load_config(CONFIG, {"attention_backend": "sdpa", "max_model_len": 2048,
                                  **overrides})
    return build_local_engine(config)


def _client(core) -> httpx.AsyncClient:
    app = create_app(LocalEngineClient(core), core.stages.verifier.runner.tokenizer,
                     ServerSettings())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             timeout=120)


def _system_prompt(chars: int = 1100, seed: int = 7) -> str:
    """Tool documentation stand-in: ~1,100 bytes, one token per byte for the tiny tokenizer."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randrange(3, 9)))
             for _ in range(400)]
    text = "You can call these tools. " + " ".join(words)
    return text[:chars]


def _user_turns(seed: int = 11) -> list[str]:
    rng = random.Random(seed)
    return [f"step {t}: " + " ".join(rng.choices(["list", "read", "grep", "open", "file", "dir"],
                                                 k=6 + t)) for t in range(TURNS)]


async def _conversation(core, stream: bool = False) -> list[dict]:
    """Six chat turns, each re-sending the whole history (greedy, 16 tokens an answer); per turn
    the usage and the answer."""
    messages = [{"role": "system", "content": _system_prompt()}]
    turns = []
    async with _client(core) as c:
        for user in _user_turns():
            messages.append({"role": "user", "content": user})
            body = {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True}
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            if stream:
                chunks = _sse(r.text)
                usage = chunks[-1]["usage"]
                text = "".join(ch["choices"][0]["delta"].get("content", "")
                               for ch in chunks if ch.get("choices"))
            else:
                usage, text = r.json()["usage"], r.json()["choices"][0]["message"]["content"]
            turns.append({"usage": usage, "text": text})
            messages.append({"role": "assistant", "content": text})
    await core.idle()
    return turns


def _sse(body: str) -> list[dict]:
    events = [b[len("data: "):] for b in body.split("\n\n") if b.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_agent_conversation_reuses_the_previous_turn_and_answers_as_without_the_cache(draft):
    on_core = _engine({"draft": draft})
    on = asyncio.run(_conversation(on_core))
    off = asyncio.run(_conversation(_engine({"draft": draft, "enable_prefix_caching": False})))
    assert [t["text"] for t in on] == [t["text"] for t in off]  # identical greedy answers
    assert on[0]["usage"]["prompt_tokens"] >= 1000
    assert [t["usage"]["prompt_tokens_details"]["cached_tokens"] for t in off] == [0] * TURNS
    assert on[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for prev, turn in itertools.pairwise(on):
        cached = turn["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.8 * prev["usage"]["prompt_tokens"]
        assert cached < turn["usage"]["prompt_tokens"]
    blocks = on_core.stages.verifier.runner.cache.blocks
    blocks.check()
    assert not blocks.tables and blocks.num_cached_free > 0  # kept for the next turn


def test_streamed_usage_carries_cached_tokens_on_chat_and_completions():
    core = _engine({"draft": "ngram"})
    chat = asyncio.run(_conversation(core, stream=True))
    assert chat[0]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(t["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1024 for t in chat[1:])

    async def completions() -> list[dict]:
        prompt = _system_prompt()
        usages = []
        async with _client(core) as c:
            for _ in range(2):  # the second sends the same prompt: all but its last block hits
                r = await c.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}})
                assert r.status_code == 200, r.text
                usages.append(_sse(r.text)[-1]["usage"])
        return usages

    first, second = asyncio.run(completions())
    n = first["prompt_tokens"]
    # the chat turns' system prompt is rendered after "system: ", so this prompt starts cold
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16


def test_the_request_span_carries_cached_tokens():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pipeline.output.processor import OutputProcessor
    from pipeline.output.spans import REQUEST_SPAN, TracedOutputProcessor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    core = _engine({"draft": "ngram"})
    stages = core.stages
    stages.output = TracedOutputProcessor(
        OutputProcessor(stages.verifier.runner.tokenizer, [2]), provider.get_tracer("test"))

    async def two_requests() -> None:
        async with _client(core) as c:
            for _ in range(2):
                r = await c.post("/v1/completions", json={
                    "model": "tiny", "prompt": _system_prompt(200), "max_tokens": 4,
                    "temperature": 0})
                assert r.status_code == 200, r.text
        await core.idle()

    asyncio.run(two_requests())
    spans = [s for s in exporter.get_finished_spans() if s.name == REQUEST_SPAN]
    assert [s.attributes["request.cached_tokens"] for s in spans] == [0, 192]
    assert [s.attributes["request.prompt_tokens"] for s in spans] == [201, 201]  # + BOS


def test_the_step_message_cached_column_round_trips_and_is_checked():
    import numpy as np

    from pipeline.protocol import ProtocolError, decode_columns, encode_columns
    from pipeline.protocol.verify_step import StepColumns

    def cols(cached):
        return StepColumns(step=3, rids=["a", "b"], lengths=np.array([1, 2]),
                           drafted=np.array([0, 2]), tokens=np.array([5, 6, 7]), cached=cached)

    got = decode_columns(encode_columns(cols(np.array([48, 0]))))
    assert got.cached.tolist() == [48, 0]
    assert decode_columns(encode_columns(cols(None))).cached is None  # optional
    with pytest.raises(ProtocolError, match="ch"):
        encode_columns(cols(np.array([-1, 0])))
    with pytest.raises(ProtocolError, match="ch"):
        encode_columns(cols(np.array([16])))


def test_batch_generate_results_report_cached_tokens():
    import os
    import sys

    from pipeline.frontend.tokenizer import TokenizerAdapter

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import batch_generate

    core = _engine({"draft": "ngram"})
    tok = TokenizerAdapter(core.stages.verifier.runner.tokenizer)
    system = _system_prompt(300)
    items = [batch_generate.parse_line(i, json.dumps({"prompt": system + f" question {i}",
                                                      "max_tokens": 4, "temperature": 0}),
                                       tok, max_model_len=2048, vocab_size=256,
                                       default_max_tokens=8) for i in range(3)]

    async def run():
        try:
            return await batch_generate.generate_all(LocalEngineClient(core), items, 1, 60.0)
        finally:
            await core.stop()

    _progress, rows = asyncio.run(run())
    assert [r["error"] for r in rows] == [None] * 3
    # one at a time: each later line reuses the shared prefix (BOS + 300 bytes + " question ":
    # 311 tokens) as whole blocks of 16
    assert [r["cached_tokens"] for r in rows] == [0, 304, 304]
