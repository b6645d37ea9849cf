"""End to end on Ray Serve with the tiny random engine: the official openai client, a few bad
requests, the API key, and a disconnecting streaming client freeing its slots.

One Serve app for the whole module (starting one costs seconds).
"""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
from support.serve_helpers import ROOT, metric, running_app

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

KEY = "test-key-123"
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def base_url(ray_cluster):
    # 2 slots and 4 waiting places: a 4-choice request keeps 2 waiting (see the 429 test).
    with running_app({"config": TINY, "api_key": KEY, "request_timeout_s": 60,
                      "overrides": {"num_slots": 2, "max_waiting": 4}},
                     name="specrelay-tiny") as base:
        yield base


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(api_key=KEY, base_url=f"{base_url}/v1", max_retries=0)


def stream_text(stream) -> tuple[str, list, object]:
    text, logprobs, last = "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        text += getattr(c, "text", None) or (c.delta.content if hasattr(c, "delta") else "") or ""
        if c.logprobs is not None:
            logprobs.append(c.logprobs)
        if c.finish_reason is not None:
            last = c
    return text, logprobs, last


def test_completions_stream_equals_non_stream_with_stop_string_and_logprobs(client):
    prompt = "The quick brown fox"
    free = client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                     extra_body={"ignore_eos": True})
    text = free.choices[0].text
    assert free.choices[0].finish_reason == "length" and len(text) >= 12, text
    stop = text[8:10]  # a stop string that certainly occurs: it ends at or before char 10
    cut = text[: text.index(stop)]

    kwargs = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "stop": [stop],
              "logprobs": 2, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kwargs)
    c = full.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (cut, "stop", stop)
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == \
        full.usage.completion_tokens
    assert all(len(t) <= 2 and len(t) >= 1 for t in c.logprobs.top_logprobs)
    assert c.model_extra["spec_stats"]["verify_ct"] >= 1

    streamed, lps, last = stream_text(client.completions.create(stream=True, **kwargs))
    assert streamed == cut
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", stop)
    assert [t for lp in lps for t in lp.tokens] == c.logprobs.tokens
    # Same tokens exactly; logprobs to float32 rounding: adaptive k varies the verify rows per
    # step, and a GEMM over a different number of rows rounds differently (~1e-6).
    assert [x for lp in lps for x in lp.token_logprobs] == pytest.approx(
        c.logprobs.token_logprobs, abs=1e-4)
    assert last.model_extra["spec_stats"]["verify_ct"] >= 1


def test_chat_stream_equals_non_stream_with_logprobs(client):
    msgs = [{"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16,
                                          logprobs=True, top_logprobs=1,
                                          extra_body={"ignore_eos": True})
    c = full.choices[0]
    assert c.finish_reason == "length" and full.usage.completion_tokens == 16
    assert len(c.logprobs.content) == 16
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16,
                                            logprobs=True, top_logprobs=1, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    tokens = [t.token for ch in chunks if ch.choices and ch.choices[0].logprobs
              for t in ch.choices[0].logprobs.content]
    assert tokens == [t.token for t in c.logprobs.content]
    assert [ch for ch in chunks if ch.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 16


def test_bad_requests_auth_and_health_on_the_real_server(base_url, client):
    with httpx.Client(base_url=base_url, timeout=30) as h:
        r = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10_000}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = h.post("/v1/completions", json={"prompt": "hi", "temperature": -1}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = h.post("/v1/chat/completions", json={"model": "nope", "messages": [
            {"role": "user", "content": "x"}]}, headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", "/metrics")]:
            r = h.request(method, path, json={"prompt": "hi"})
            assert r.status_code == 401, path
        assert h.get("/health").status_code == 200
        models = h.get("/v1/models", headers=AUTH).json()
        assert models["data"][0]["id"] == "tiny"
    # Still serving after all that.
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=3).usage \
        .completion_tokens >= 1


def test_full_engine_gives_429_then_disconnecting_stream_frees_its_slots(base_url):
    def stats():
        text = httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=10).text
        return {k: metric(text, f"specrelay_{k}") for k in
                ("num_requests_running", "num_requests_waiting", "num_free_slots",
                 "engine_steps_total")}

    before = stats()
    assert before["num_requests_running"] == 0
    max_tokens = 200  # with k=4 a choice needs >= 40 verify steps to finish
    body = {"model": "tiny", "prompt": "go", "max_tokens": max_tokens, "n": 4,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base_url, timeout=30) as h, \
            h.stream("POST", "/v1/completions", headers=AUTH, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        busy = stats()
        # One choice runs; the other slot is kept for a lone request (reserved_slots: 1).
        assert busy["num_requests_running"] == 1 and busy["num_free_slots"] == 1
        start_steps = busy["engine_steps_total"]
        # One choice runs, three wait: 3 more do not fit the 4 waiting places.
        t0 = time.monotonic()
        refused = h.post("/v1/completions", headers=AUTH,
                         json={"model": "tiny", "prompt": "more", "max_tokens": 2, "n": 3})
        assert refused.status_code == 429 and time.monotonic() - t0 < 5
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "engine_overloaded"
    # Closed after the first chunk: the server aborts, the engine frees all four slots.
    deadline = time.monotonic() + 10
    while True:
        now = stats()
        if (now["num_requests_running"], now["num_requests_waiting"], now["num_free_slots"]) \
                == (0, 0, before["num_free_slots"]):
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    assert now["engine_steps_total"] - start_steps < max_tokens / 5, now


def test_non_streaming_client_that_gives_up_aborts_its_request(base_url):
    def stats():
        text = httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=10).text
        return {k: metric(text, f"specrelay_{k}") for k in
                ("num_requests_running", "num_requests_waiting", "engine_steps_total")}

    start = stats()
    # 4 choices of 240 tokens on 2 slots need >= 2 * 240 / 5 = 96 verify steps to finish.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", headers=AUTH, timeout=0.25, json={
            "model": "tiny", "prompt": "go", "max_tokens": 240, "n": 4, "ignore_eos": True})
    deadline = time.monotonic() + 10
    while True:
        now = stats()
        if (now["num_requests_running"], now["num_requests_waiting"]) == (0, 0):
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    assert now["engine_steps_total"] - start["engine_steps_total"] < 96, now
