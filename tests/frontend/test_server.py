"""The FastAPI app in-process over a fake engine (httpx ASGI transport and the openai client).

Fast: no Ray, no sockets. The real server (Ray Serve + tiny engine) is in test_serve_app.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from support.server_fakes import EOS, SCRIPT, ByteTok, FakeEngine, fake_logprob

from pipeline.errors import EngineOverloadedError
from pipeline.frontend.app import ServerSettings, create_app

pytestmark = pytest.mark.timeout(60)


def client_for(engine: FakeEngine, **settings) -> httpx.AsyncClient:
    app = create_app(engine, ByteTok(), ServerSettings(**settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse_events(body: str) -> list:
    events = []
    for block in body.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def post(engine: FakeEngine, path: str, body, **settings) -> httpx.Response:
    async with client_for(engine, **settings) as c:
        if isinstance(body, (bytes, str)):
            return await c.post(path, content=body, headers={"content-type": "application/json"})
        return await c.post(path, json=body)


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------- happy paths


def test_completion_stops_at_stop_string_with_stop_reason_and_spec_stats():
    r = run(post(FakeEngine(), "/v1/completions",
                 {"model": "fake-model", "prompt": "hi", "max_tokens": 40, "stop": ["This"]}))
    assert r.status_code == 200
    body = r.json()
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        "Hello world! ", "stop", "This")
    # 17 tokens ("Hello world! This") in windows of 3: 6 verify steps.
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 17, "total_tokens": 19}
    assert choice["spec_stats"] == {"verify_ct": 6, "accepted_tokens": 11,
                                    "acceptance_histogram": [0, 1, 5], "draft_tokens": 12}


def test_length_finish_and_eos_stop_reason_is_null():
    r = run(post(FakeEngine(), "/v1/completions", {"prompt": "hi", "max_tokens": 5}))
    c = r.json()["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == ("Hello", "length", None)
    r = run(post(FakeEngine(eos_after=4), "/v1/completions", {"prompt": "hi", "max_tokens": 9}))
    c = r.json()["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == ("Hell", "stop", None)
    r = run(post(FakeEngine(), "/v1/completions",
                 {"prompt": "hi", "max_tokens": 9, "stop_token_ids": [ord("o")]}))
    c = r.json()["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == ("Hello", "stop", ord("o"))


def test_streamed_completion_equals_non_streamed_with_per_chunk_logprobs():
    req = {"prompt": "hi", "max_tokens": 30, "stop": ["the"], "logprobs": 2}
    plain = run(post(FakeEngine(), "/v1/completions", req)).json()["choices"][0]
    r = run(post(FakeEngine(), "/v1/completions",
                 {**req, "stream": True, "stream_options": {"include_usage": True}}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "content-length" not in r.headers
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    chunks = events[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(
        plain["logprobs"]["tokens"])
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"] == (
        "Hello world! This is ")
    for c in chunks:  # logprobs of exactly that chunk's tokens, aligned with its text offsets
        lp = c["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        assert "".join(lp["tokens"]) == c["choices"][0]["text"] or c["choices"][0]["finish_reason"]
    all_tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert all_tokens == plain["logprobs"]["tokens"]
    assert [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]] == [
        fake_logprob(ord(t)) for t in all_tokens]
    assert [x for c in chunks for x in c["choices"][0]["logprobs"]["text_offset"]] == \
        plain["logprobs"]["text_offset"] == list(range(len(all_tokens)))
    final = chunks[-1]["choices"][0]
    assert (final["finish_reason"], final["stop_reason"]) == ("stop", "the")
    assert final["spec_stats"] == plain["spec_stats"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_chat_with_openai_client_stream_and_non_stream_agree():
    async def go():
        async with client_for(FakeEngine()) as http:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http)
            msgs = [{"role": "user", "content": "Say hello"}]
            full = await client.chat.completions.create(
                model="fake-model", messages=msgs, max_tokens=20, stop=["!"], logprobs=True,
                top_logprobs=2)
            stream = await client.chat.completions.create(
                model="fake-model", messages=msgs, max_tokens=20, stop=["!"], logprobs=True,
                top_logprobs=2, stream=True, stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            return full, chunks

    full, chunks = run(go())
    choice = full.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("Hello world", "stop")
    assert choice.model_extra["stop_reason"] == "!"
    assert [t.token for t in choice.logprobs.content] == list("Hello world!")
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    streamed_tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                       for t in c.choices[0].logprobs.content]
    assert streamed_tokens == list("Hello world!")
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", "!")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 12


def test_n_choices_get_derived_seeds_and_distinct_samples():
    engine = FakeEngine()
    r = run(post(engine, "/v1/completions",
                 {"prompt": "hi", "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 5}))
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    seeds = [p.seed for p in engine.requests.values()]
    assert seeds[0] == 5 and len(set(seeds)) == 3
    texts = {c["text"] for c in body["choices"]}
    assert len(texts) == 3
    assert body["usage"]["completion_tokens"] == 12


def test_batched_prompts_and_include_stop_str():
    r = run(post(FakeEngine(), "/v1/completions",
                 {"prompt": ["a", "bb"], "max_tokens": 20, "stop": "world",
                  "include_stop_str_in_output": True}))
    body = r.json()
    assert [c["text"] for c in body["choices"]] == ["Hello world"] * 2
    assert body["usage"]["prompt_tokens"] == 3


def test_models_and_health_and_metrics():
    engine = FakeEngine()

    async def go():
        async with client_for(engine) as c:
            models = (await c.get("/v1/models")).json()
            ok = await c.get("/health")
            await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6})
            await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
            metrics = (await c.get("/metrics")).text
            engine.healthy = False
            bad = await c.get("/health")
            return models, ok, metrics, bad

    models, ok, metrics, bad = run(go())
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["max_model_len"] == 128
    assert ok.status_code == 200 and ok.json()["healthy"] is True
    assert bad.status_code == 503 and bad.json()["reason"] == "step loop stalled"
    assert 'specrelay_generation_tokens_total{model="fake-model"} 6.0' in metrics
    assert 'specrelay_time_to_first_token_seconds_count{model="fake-model"} 1.0' in metrics
    assert 'specrelay_inter_token_latency_seconds_count{model="fake-model"} 3.0' in metrics
    assert 'specrelay_http_requests_total{route="/v1/completions",status="400"} 1.0' in metrics
    assert 'specrelay_spec_dropped_steps_total{model="fake-model"} 2.0' in metrics
    assert 'specrelay_spec_acceptance_rate{model="fake-model"} 0.75' in metrics
    assert 'specrelay_num_requests_running{model="fake-model"} 0.0' in metrics


# ------------------------------------------------------------------------- errors


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**31}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 127}, "max_tokens"),  # 2 + 127 > 128
    ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "temperature": 1e999}', "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 100000}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 100}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 600}, "stop"),
    ("/v1/completions", '{"prompt": "bad \\ud800 surrogate"}', "prompt"),
    ("/v1/completions", '{"prompt": "nul \\u0000 char"}', "prompt"),
    ("/v1/completions", {"prompt": "x" * 200}, "prompt"),  # longer than the context
    ("/v1/completions", {"prompt": [1, 999]}, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"max_tokens": 3}, "prompt"),  # missing
    ("/v1/completions", "not json", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
]


def test_bad_requests_get_400_openai_error_bodies_and_the_server_keeps_serving():
    async def go():
        async with client_for(FakeEngine()) as c:
            out = []
            for path, body, _ in BAD_REQUESTS:
                if isinstance(body, str):
                    r = await c.post(path, content=body,
                                     headers={"content-type": "application/json"})
                else:
                    r = await c.post(path, json=body)
                out.append(r)
            ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            return out, ok

    responses, ok = run(go())
    for (path, body, param), r in zip(BAD_REQUESTS, responses):
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param, (body, err)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "He"


def test_unknown_model_is_404_model_not_found():
    r = run(post(FakeEngine(), "/v1/completions", {"model": "gpt-9", "prompt": "hi"}))
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"


def test_unknown_route_is_an_openai_style_404():
    r = run(post(FakeEngine(), "/v1/embeddings", {"input": "x"}))
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_body_over_the_limit_is_413_with_and_without_content_length():
    big = json.dumps({"prompt": "a" * 5000})
    r = run(post(FakeEngine(), "/v1/completions", big, max_body_bytes=4096))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    async def chunked():
        async def gen():
            for _ in range(10):
                yield b" " * 1000
        async with client_for(FakeEngine(), max_body_bytes=4096) as c:
            return await c.post("/v1/completions", content=gen())
    r = run(chunked())
    assert r.status_code == 413


def test_headers_over_the_limit_are_431():
    async def go():
        async with client_for(FakeEngine(), max_header_bytes=2048) as c:
            return await c.get("/v1/models", headers={"x-junk": "j" * 4000})
    r = run(go())
    assert r.status_code == 431


def test_api_key_guards_every_route_but_health():
    engine = FakeEngine()

    async def go():
        out = {}
        async with client_for(engine, api_key="s3cret") as c:
            for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("GET", "/v1/models"), ("GET", "/metrics"),
                                 ("GET", "/v1/unknown")]:
                out[path] = await c.request(method, path, json={"prompt": "hi"})
                wrong = await c.request(method, path, json={"prompt": "hi"},
                                        headers={"Authorization": "Bearer nope"})
                assert wrong.status_code == 401
            out["health"] = await c.get("/health")
            out["ok"] = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                     headers={"Authorization": "Bearer s3cret"})
        return out

    out = run(go())
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics",
                 "/v1/unknown"):
        assert out[path].status_code == 401, path
        assert out[path].json()["error"]["code"] == "invalid_api_key"
    assert out["health"].status_code == 200
    assert out["ok"].status_code == 200
    assert engine.requests and all(p.max_new_tokens == 2 for p in engine.requests.values())


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("SPECRELAY_API_KEY", "envkey")
    async def go():
        async with client_for(FakeEngine()) as c:
            return ((await c.get("/v1/models")).status_code,
                    (await c.get("/v1/models", headers={"Authorization": "Bearer envkey"}))
                    .status_code)
    assert run(go()) == (401, 200)


def test_full_queue_is_429_with_retry_after_and_streams_too():
    engine = FakeEngine(num_slots=0)
    r = run(post(engine, "/v1/completions", {"prompt": "hi"}, retry_after_s=3))
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "engine_overloaded"
    r = run(post(engine, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "x"}], "stream": True}))
    assert r.status_code == 429


def test_a_later_choice_refused_is_a_429_before_any_output_is_sent():
    """Each choice is queued on its own: the first may already have output when a later one is
    refused. The stream must not have started then (vLLM never answers part of a request)."""
    async def admit(call):
        if call.rid.endswith("-1"):
            await asyncio.sleep(0.3)  # while choice 0 runs
            raise EngineOverloadedError("waiting queue is full")

    engine = FakeEngine(admit=admit, step_delay=0.05)  # choice 0: 20 deltas in ~1 s
    r = run(post(engine, "/v1/completions",
                 {"prompt": "hi", "n": 2, "max_tokens": 60, "stream": True}))
    assert r.status_code == 429 and r.json()["error"]["code"] == "engine_overloaded"
    assert any(rid.endswith("-0") for rid in engine.aborted) and not engine.running
    assert not engine.finished


def test_queued_choices_do_not_hold_back_the_stream():
    """Every choice queued: the stream starts with the first output of any of them."""
    queued = asyncio.Event()

    async def admit(call):
        if call.rid.endswith("-1"):
            queued.set()

    engine = FakeEngine(admit=admit, step_delay=0.01)
    real = engine._outputs

    async def outputs(rid, params):
        if rid.endswith("-1"):
            await asyncio.sleep(3600)  # queued for a slot, never reached
        async for out in real(rid, params):
            yield out

    engine._outputs = outputs
    r = run(post(engine, "/v1/completions",
                 {"prompt": "hi", "n": 2, "max_tokens": 6, "stream": True},
                 request_timeout_s=2))
    events = sse_events(r.text)
    assert r.status_code == 200 and queued.is_set()
    assert "".join(e["choices"][0]["text"] for e in events[:-2]
                   if e.get("choices")) == SCRIPT[:6]
    assert events[-2]["error"]["code"] == "request_timeout"


def test_request_timeout_is_408_and_aborts_the_engine_request():
    engine = FakeEngine(hang=True)
    r = run(post(engine, "/v1/completions", {"prompt": "hi"}, request_timeout_s=0.2))
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    assert engine.aborted == list(engine.requests)


def test_timeout_mid_stream_reports_an_error_event_then_done():
    engine = FakeEngine(step_delay=0.15)
    r = run(post(engine, "/v1/completions",
                 {"prompt": "hi", "max_tokens": 60, "stream": True}, request_timeout_s=0.5))
    events = sse_events(r.text)
    assert r.status_code == 200
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert engine.aborted == list(engine.requests) and not engine.running


# ------------------------------------------------------------------------- disconnects


async def asgi_call(app, body: dict, disconnect_after_chunks: int | None,
                    disconnect_after_s: float | None = None) -> list[dict]:
    """Drive the app like a server would, then report http.disconnect at the chosen moment."""
    raw = json.dumps(body).encode()
    sent: list[dict] = []
    disconnected = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if disconnect_after_s is not None:
            await asyncio.sleep(disconnect_after_s)
            return {"type": "http.disconnect"}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if disconnect_after_chunks is not None and len(chunks) >= disconnect_after_chunks:
            disconnected.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


def test_streaming_client_disconnect_aborts_and_frees_slots():
    engine = FakeEngine(step_delay=0.05)
    app = create_app(engine, ByteTok(), ServerSettings())

    async def go():
        sent = await asgi_call(app, {"prompt": "hi", "max_tokens": 100, "stream": True, "n": 2},
                               disconnect_after_chunks=2)
        await asyncio.sleep(0.1)  # let the fire-and-forget aborts run
        return sent, await engine.stats()

    sent, stats = run(go())
    assert sent[0]["status"] == 200
    assert sorted(engine.aborted) == sorted(engine.requests) and len(engine.requests) == 2
    assert engine.finished == []
    assert stats["running"] == 0 and stats["free_slots"] == engine.num_slots


def test_non_streaming_client_disconnect_aborts_and_frees_slots():
    engine = FakeEngine(step_delay=0.05)
    app = create_app(engine, ByteTok(), ServerSettings())

    async def go():
        await asgi_call(app, {"prompt": "hi", "max_tokens": 100}, disconnect_after_chunks=None,
                        disconnect_after_s=0.2)
        await asyncio.sleep(0.1)
        return await engine.stats()

    stats = run(go())
    assert engine.aborted == list(engine.requests) and engine.finished == []
    assert stats["running"] == 0


def test_eos_token_is_not_in_text_but_counted():
    r = run(post(FakeEngine(eos_after=2), "/v1/completions",
                 {"prompt": "hi", "max_tokens": 9, "logprobs": 0}))
    c = r.json()["choices"][0]
    assert c["text"] == "He" and r.json()["usage"]["completion_tokens"] == 3
    assert c["logprobs"]["tokens"][-1] == ByteTok().decode([EOS], skip_special_tokens=False)
    assert SCRIPT.startswith(c["text"])


def test_choices_over_the_per_request_cap_are_a_400_naming_prompt_and_n():
    engine = FakeEngine(num_slots=8, max_waiting=64)
    r = run(post(engine, "/v1/completions", {"prompt": ["a"] * 16, "n": 16, "max_tokens": 4}))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "too_many_choices" and "prompt, n" in err["message"]
    assert "256 choices" in err["message"] and engine.requests == {}  # nothing started
    r = run(post(engine, "/v1/completions", {"prompt": ["a"] * 4, "n": 2, "max_tokens": 4},
                 max_choices_per_request=8))
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_the_choices_of_one_request_share_its_id_as_their_admission_group():
    engine = FakeEngine(num_slots=8, max_waiting=8)
    r = run(post(engine, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 4}))
    assert r.status_code == 200
    assert set(engine.groups.values()) == {r.json()["id"]} and len(engine.groups) == 4


def test_each_api_key_and_user_reaches_the_engine_as_its_own_tenant_hash():
    engine = FakeEngine(num_slots=8, max_waiting=8)

    async def send(key: str, user: str | None) -> str:
        body = {"prompt": "a", "max_tokens": 2, **({"user": user} if user else {})}
        async with client_for(engine, api_key="") as c:
            r = await c.post("/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        return engine.tenants[f"{r.json()['id']}-0"]

    a, a_again, b, a_user = (run(send(*x)) for x in
                             [("key-a", None), ("key-a", None), ("key-b", None), ("key-a", "u1")])
    assert a == a_again and len({a, b, a_user}) == 3
    assert all(len(t) == 32 and "key" not in t for t in (a, b, a_user))  # a hash, not the key


def test_metrics_report_the_engine_unhealthy_when_it_stops_answering_for_stats():
    engine = FakeEngine()

    async def go():
        async with client_for(engine) as c:
            first = (await c.get("/metrics")).text

            async def broken():
                raise RuntimeError("engine gone")

            engine.stats = broken
            return first, (await c.get("/metrics")).text

    first, after = run(go())
    assert 'specrelay_engine_healthy{model="fake-model"} 1.0' in first
    assert 'specrelay_engine_healthy{model="fake-model"} 0.0' in after
    assert 'specrelay_engine_steps_total{model="fake-model"} 10.0' in after  # last counts kept


def test_an_engine_call_that_fails_before_streaming_ends_the_request_with_an_error():
    class Refusing(FakeEngine):
        def generate(self, *args, **kwargs):  # fails when called, before any await
            raise TypeError("generate() got an unexpected keyword argument")

    async def go():
        async with client_for(Refusing()) as c:
            return await asyncio.wait_for(
                c.post("/v1/completions", json={"model": "fake-model", "prompt": "a"}), 10)

    r = run(go())
    assert r.status_code >= 500 and r.json()["error"]["message"]
