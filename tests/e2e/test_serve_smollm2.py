"""The real model behind the real server: SmolLM2-135M-Instruct (GGUF) with n-gram drafting on
Ray Serve, driven by the official openai client."""

from __future__ import annotations

import os

import openai
import pytest
from support.serve_helpers import ROOT, running_app

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(400)]

CONFIG = os.path.join(ROOT, "configs", "smollm2-cpu.yaml")
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(ray_cluster):
    with running_app({"config": CONFIG, "request_timeout_s": 120}, name="specrelay-smollm2") \
            as base:
        yield openai.OpenAI(api_key="unused", base_url=f"{base}/v1", max_retries=0)


def test_chat_answers_and_stream_matches_with_stop_string(client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40,
                                          temperature=0, logprobs=True, top_logprobs=3)
    c = full.choices[0]
    assert "Paris" in c.message.content
    assert c.finish_reason in ("stop", "length")
    assert len(c.logprobs.content) == full.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in c.logprobs.content)

    stop = "Paris"
    kwargs = {"model": MODEL, "messages": msgs, "max_tokens": 40, "temperature": 0,
              "stop": [stop], "logprobs": True}
    cut = client.chat.completions.create(**kwargs).choices[0]
    assert cut.message.content == c.message.content[: c.message.content.index(stop)]
    assert (cut.finish_reason, cut.model_extra["stop_reason"]) == ("stop", stop)

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == cut.message.content
    last = [ch for ch in chunks if ch.choices][-1].choices[0]
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", stop)
    streamed = [t.token for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert streamed == [t.token for t in cut.logprobs.content]


def test_completion_stream_equals_non_stream_and_reports_speculation(client):
    # Repetitive text: n-gram drafting should get drafts accepted.
    prompt = "one two three four one two three four one two three four one two"
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
              "logprobs": 1}
    full = client.completions.create(**kwargs).choices[0]
    assert full.finish_reason == "length"
    spec = full.model_extra["spec_stats"]
    assert spec["accepted_tokens"] > 0 and spec["verify_ct"] >= 1
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.text
    assert [t for ch in chunks if ch.choices and ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.tokens] == full.logprobs.tokens
    assert chunks[-1].choices[0].finish_reason == "length"
