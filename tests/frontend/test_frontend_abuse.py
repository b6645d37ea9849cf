"""Issue 17, the front end under abuse (in-process over the fake engine, no Ray, fast):

- any string a client sends, in any string field of either endpoint, gets an OpenAI-shaped 4xx
  (or a 200 where the value is fine), never a 5xx;
- client-facing errors and /health carry a short message and an error id, never internals
  (the details are in the server log under that id);
- 401s carry `WWW-Authenticate: Bearer`; two Authorization headers are a 400;
- parameters the server does not implement get a 400 naming them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.server_fakes import ByteTok, FakeEngine, call, check_openai_error

from pipeline.errors import EngineDeadError
from pipeline.frontend.app import ServerSettings, create_app

pytestmark = pytest.mark.timeout(300)

C, CHAT = "/v1/completions", "/v1/chat/completions"
KEY = "sekrit-key"
ERROR_ID = re.compile(r"\(error id: (err_[0-9a-f]{16})\)")
# Ray's formatting of a dead actor: what must never reach a client.
RAY_DETAIL = ("The actor died unexpectedly before finishing this task.\n\tclass_name: Engine\n"
              "\tactor_id: 8f1c2d3e4b5a69788796a5b4c3d2e1f0\n\tpid: 4242\n\tnamespace: serve\n"
              "\tip: 10.1.2.3\n\x1b[31mThe actor is dead because its worker process has died."
              "\x1b[0m Memory on the node was low at the time of the OOM-kill: see "
              "`ray logs raylet.out -ip 10.1.2.3`.")
LEAKS = ("actor_id", "pid", "10.1.2.3", "namespace", "\x1b", "\\u001b", "OOM", "raylet")


def app_for(engine: Any = None, **settings_kw: Any) -> Any:
    return create_app(engine or FakeEngine(), ByteTok(), ServerSettings(**settings_kw))


# --------------------------------------------------------------------------- the string fuzz

HOSTILE = st.one_of(
    st.text(),  # any Unicode, lone surrogates included
    st.lists(st.sampled_from(["\ud800", "\udfff", "\x00", "\x1b[31m", "\r\n", "\u2028", "\ufeff",
                              "\\", '"', "a", "é", "\U0001f600"]), max_size=40).map("".join),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "\ud800", "\x00", "é"]),
              st.sampled_from([10_000, 200_000])),  # huge, but under the 1 MiB body limit
)

MSG = {"role": "user", "content": "hi"}
# (endpoint, where the string goes). Each one replaces a valid body's field.
STRING_FIELDS = [
    (C, ("model",)), (C, ("prompt",)), (C, ("prompt", 1)), (C, ("stop",)), (C, ("stop", 0)),
    (C, ("user",)), (C, ("suffix",)), (C, ("max_tokens",)), (C, ("temperature",)),
    (C, ("seed",)), (C, ("logit_bias", "key")), (C, ("response_format", "type")),
    (C, ("key",)), (C, ("stream_options", "include_usage")),
    (CHAT, ("model",)), (CHAT, ("messages", 0, "content")), (CHAT, ("messages", 0, "role")),
    (CHAT, ("messages", 0, "name")), (CHAT, ("messages", 1, "content", 0, "text")),
    (CHAT, ("messages", 1, "content", 0, "type")), (CHAT, ("stop",)), (CHAT, ("stop", 1)),
    (CHAT, ("user",)), (CHAT, ("top_logprobs",)), (CHAT, ("tools", 0, "type")),
    (CHAT, ("messages", 2, "tool_calls", 0, "id")), (CHAT, ("key",)),
]


def base_body(path: str, stream: bool) -> dict[str, Any]:
    if path == C:
        return {"model": "fake-model", "prompt": ["a", "b"], "max_tokens": 4,
                "stop": ["zz"], "stream": stream}
    return {"model": "fake-model", "max_tokens": 4, "stop": ["zz", "yy"], "stream": stream,
            "messages": [dict(MSG), {"role": "user", "content": [{"type": "text", "text": "x"}]},
                         {"role": "assistant", "content": "ok"}]}


def put(body: dict[str, Any], where: tuple, value: str) -> dict[str, Any]:
    """`body` with `value` at `where`; "key" as the last step makes `value` a dict key there."""
    node: Any = body
    for step in where[:-1]:
        if isinstance(node, list):
            while len(node) <= step:
                node.append({})
            node = node[step]
        else:
            node = node.setdefault(step, [] if isinstance(step, str) and step in (
                "tools", "tool_calls", "content") else {})
    last = where[-1]
    if last == "key":
        node[value] = 1
    elif isinstance(node, list):
        while len(node) <= last:
            node.append("")
        node[last] = value
    else:
        node[last] = value
    return body


FUZZ_APP = app_for(request_timeout_s=20)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(STRING_FIELDS), value=HOSTILE, stream=st.booleans())
def test_any_string_in_any_field_is_an_openai_4xx_or_a_200_never_a_5xx(field, value, stream):
    path, where = field
    r = asyncio.run(call(FUZZ_APP, "POST", path, put(base_body(path, stream), where, value)))
    assert r.status_code < 500, (field, r.status_code, r.text[:300])
    if r.status_code != 200:
        check_openai_error(r)
        return
    if stream:  # every event is JSON, the stream ends with [DONE]
        events = [b[len("data: "):] for b in r.text.split("\n\n") if b.strip()]
        assert events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-1])
    else:
        assert r.json()["choices"], r.text[:300]


@pytest.mark.parametrize("path", [C, CHAT])
def test_a_lone_surrogate_in_model_is_a_json_404(path):
    body = {"model": "\ud800", "prompt": "a", "max_tokens": 4} if path == C else {
        "model": "\ud800", "messages": [MSG], "max_tokens": 4}
    r = asyncio.run(call(app_for(), "POST", path, body))
    assert r.status_code == 404
    err = check_openai_error(r)
    assert err == {"message": "The model `\\ud800` does not exist.", "type":
                   "invalid_request_error", "param": "model", "code": "model_not_found"}


def test_a_huge_model_name_is_echoed_cut_short():
    r = asyncio.run(call(app_for(), "POST", C, {"model": "m" * 500_000, "prompt": "a"}))
    assert r.status_code == 404 and len(r.content) < 400
    assert check_openai_error(r)["message"] == f"The model `{'m' * 80}...` does not exist."


# --------------------------------------------------------------------------- no internals leak


class DeadEngine(FakeEngine):
    """An engine whose every call fails the way Ray reports a dead actor."""

    async def generate(self, *args: Any, **kw: Any) -> Any:
        raise EngineDeadError(f"engine actor unavailable: {RAY_DETAIL}")
        yield  # an async generator, like the real client

    async def health(self) -> dict[str, Any]:
        return {"healthy": False, "reason": f"rebuilding after: EngineDeadError: {RAY_DETAIL}"}


@pytest.mark.parametrize("stream", [False, True])
def test_engine_errors_reach_the_client_as_a_short_message_and_an_id_in_the_log(stream, caplog):
    caplog.set_level(logging.WARNING, logger="pipeline.frontend")
    r = asyncio.run(call(app_for(DeadEngine()), "POST", C,
                         {"prompt": "a", "max_tokens": 4, "stream": stream}))
    assert r.status_code == 503
    err = check_openai_error(r)
    error_id = ERROR_ID.search(err["message"]).group(1)
    assert err["message"] == f"engine unavailable, retry later (error id: {error_id})"
    assert not [leak for leak in LEAKS if leak in r.text]
    logged = [rec.getMessage() for rec in caplog.records if error_id in rec.getMessage()]
    assert len(logged) == 1 and "actor_id: 8f1c2d3e" in logged[0] and "pid: 4242" in logged[0]


def test_unauthenticated_health_gives_a_short_reason_and_logs_the_details(caplog):
    caplog.set_level(logging.WARNING, logger="pipeline.frontend")
    app = app_for(DeadEngine(), api_key=KEY)
    first = asyncio.run(call(app, "GET", "/health"))
    again = asyncio.run(call(app, "GET", "/health"))
    assert first.status_code == again.status_code == 503
    reason = first.json()["reason"]
    error_id = ERROR_ID.search(reason).group(1)
    assert reason == f"rebuilding after (error id: {error_id})" == again.json()["reason"]
    assert not [leak for leak in LEAKS if leak in first.text]
    logged = [rec.getMessage() for rec in caplog.records if error_id in rec.getMessage()]
    assert len(logged) == 1 and "pid: 4242" in logged[0]  # once per distinct reason


def test_a_plain_health_reason_is_kept():
    engine = FakeEngine(healthy=False)
    r = asyncio.run(call(app_for(engine), "GET", "/health"))
    assert (r.status_code, r.json()) == (503, {"healthy": False, "reason": "step loop stalled"})


# --------------------------------------------------------------------------- auth edges

AUTH_ROUTES = [("POST", C), ("POST", CHAT), ("GET", "/v1/models"), ("GET", "/metrics"),
               ("GET", "/openapi.json"), ("GET", "/nope")]


@pytest.mark.parametrize(("method", "path"), AUTH_ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic c2Vrcml0LWtleQ==", "Bearer "])
def test_every_401_carries_www_authenticate_bearer(method, path, auth):
    headers = [] if auth is None else [("authorization", auth)]
    r = asyncio.run(call(app_for(api_key=KEY), method, path, {"prompt": "a"}, headers))
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == 'Bearer realm="specrelay"'
    assert check_openai_error(r)["code"] == "invalid_api_key"


@pytest.mark.parametrize("second", [f"Bearer {KEY}", "Bearer wrong"])
@pytest.mark.parametrize("first", [f"Bearer {KEY}", "Bearer wrong"])
def test_two_authorization_headers_are_a_400_whichever_comes_first(first, second):
    headers = [("authorization", first), ("authorization", second)]
    r = asyncio.run(call(app_for(api_key=KEY), "POST", C, {"prompt": "a", "max_tokens": 2},
                         headers))
    assert r.status_code == 400
    assert check_openai_error(r)["code"] == "duplicate_authorization_header"


def test_one_authorization_header_with_the_key_still_works():
    headers = [("authorization", f"Bearer {KEY}")]
    r = asyncio.run(call(app_for(api_key=KEY), "POST", C, {"prompt": "a", "max_tokens": 2},
                         headers))
    assert r.status_code == 200


# --------------------------------------------------------------------------- unsupported params

UNSUPPORTED = [
    (CHAT, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}],
     "tools"),
    (CHAT, "tool_choice", "auto", "tool_choice"),
    (CHAT, "tool_choice", "none", "tool_choice"),
    (CHAT, "guided_grammar", "root ::= \"a\"", "guided_grammar"),
    (CHAT, "structured_outputs", {"regex": "a"}, "structured_outputs"),
    (CHAT, "functions", [{"name": "f"}], "functions"),
    (CHAT, "function_call", "auto", "function_call"),
    (CHAT, "modalities", ["text", "audio"], "modalities"),
    (CHAT, "reasoning_effort", "low", "reasoning_effort"),
    (C, "guided_grammar", "root ::= \"a\"", "guided_grammar"),
    (C, "tools", [], "tools"),
]


@pytest.mark.parametrize(("path", "name", "value", "param"), UNSUPPORTED,
                         ids=[f"{p[-11:]}-{n}-{json.dumps(v)[:20]}" for p, n, v, _ in UNSUPPORTED])
def test_unsupported_parameters_are_a_400_naming_them(path, name, value, param):
    body = {"prompt": "a"} if path == C else {"messages": [MSG]}
    r = asyncio.run(call(app_for(), "POST", path, {**body, name: value}))
    assert r.status_code == 400
    err = check_openai_error(r)
    assert (err["param"], err["code"]) == (param, "unsupported_parameter")
    assert err["message"].startswith(f"{param}: ")


@pytest.mark.parametrize("field", ["tool_calls", "function_call", "tool_call_id", "refusal"])
def test_unsupported_message_fields_are_a_400_naming_them(field):
    messages = [MSG, {"role": "assistant", "content": "x", field: [{"id": "c1"}]}]
    r = asyncio.run(call(app_for(), "POST", CHAT, {"messages": messages}))
    assert r.status_code == 400
    assert check_openai_error(r)["param"] == f"messages[1].{field}"


@pytest.mark.parametrize("extra", [{"tools": None, "response_format": None},
                                   {"modalities": ["text"], "parallel_tool_calls": False},
                                   {"user": "u", "metadata": {"a": "b"}, "store": False}])
def test_null_or_no_op_values_of_those_parameters_are_fine(extra):
    r = asyncio.run(call(app_for(), "POST", CHAT, {"messages": [MSG], "max_tokens": 2, **extra}))
    assert r.status_code == 200, r.text



# --------------------------------------------------------------------------- Serve's proxy routes


async def proxy_call(path: str, client_host: str, headers: list[tuple[str, str]]) -> int:
    """Status of `path` through SystemRoutesGuard in front of a stand-in for Serve's proxy."""
    from pipeline.frontend.proxy_guard import SystemRoutesGuard

    async def proxy(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"success"})

    transport = httpx.ASGITransport(app=SystemRoutesGuard(proxy, api_key=KEY),
                                    client=(client_host, 5000))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        r = await c.get(path, headers=headers)
    if r.status_code == 401:
        assert r.headers["www-authenticate"].startswith("Bearer")
    return r.status_code


@pytest.mark.parametrize(("path", "client_host", "auth", "status"), [
    ("/-/routes", "10.0.0.9", None, 401), ("/-/routes", "127.0.0.1", None, 401),
    ("/-/routes", "10.0.0.9", f"Bearer {KEY}", 200), ("/-/healthz", "10.0.0.9", None, 401),
    ("/-/healthz", "10.0.0.9", "Bearer wrong", 401), ("/-/healthz", "127.0.0.1", None, 200),
    ("/-/healthz", "10.0.0.9", f"Bearer {KEY}", 200), ("/v1/models", "10.0.0.9", None, 200),
])
def test_serve_proxy_system_routes_are_behind_the_key(path, client_host, auth, status):
    headers = [] if auth is None else [("authorization", auth)]
    assert asyncio.run(proxy_call(path, client_host, headers)) == status


# --------------------------------------------------------------------------- WebSocket upgrades


def websocket_refusal(app: Any, path: str, headers: dict[str, str]) -> tuple[int, dict]:
    """(status, error body) of a real WebSocket handshake to `path` (starlette's TestClient
    speaks the ASGI WebSocket Denial Response extension, as uvicorn does)."""
    from starlette.testclient import TestClient, WebSocketDenialResponse

    client = TestClient(app, client=("10.0.0.9", 5000))  # no lifespan: the stand-ins have none
    with pytest.raises(WebSocketDenialResponse) as denied, client.websocket_connect(path,
                                                                                    headers=headers):
        pass
    r = denied.value
    assert r.headers["content-type"].startswith("application/json"), r.content[:200]
    return r.status_code, r.json()["error"]


WS_PATHS = ["/-/routes", "/-/healthz", "/v1/models", "/v1/chat/completions", "/health",
            "/metrics", "/nowhere"]


@pytest.mark.parametrize("path", WS_PATHS)
@pytest.mark.parametrize("auth", [None, f"Bearer {KEY}", "Bearer wrong"])
def test_a_websocket_upgrade_through_the_proxy_guard_is_a_json_4xx_on_every_path(path, auth):
    from pipeline.frontend.proxy_guard import SystemRoutesGuard

    async def serve_proxy(scope: dict, receive: Any, send: Any) -> None:
        # Serve's proxy answers a WebSocket to its own routes with a plain-text 500
        if scope["type"] == "websocket" and scope["path"].startswith("/-/"):
            raise RuntimeError("proxy: websocket to a system route")
        await app_for(api_key=KEY)(scope, receive, send)

    headers = {} if auth is None else {"authorization": auth}
    status, err = websocket_refusal(SystemRoutesGuard(serve_proxy, api_key=KEY), path, headers)
    if auth != f"Bearer {KEY}" and path.startswith("/-/"):  # the system routes' key rule
        assert (status, err["code"]) == (401, "invalid_api_key")
    else:
        assert (status, err["code"]) == (400, "websocket_not_supported")


@pytest.mark.parametrize("key", [None, KEY])
@pytest.mark.parametrize("auth", [None, f"Bearer {KEY}"])
@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/health", "/metrics", "/x"])
def test_a_websocket_upgrade_to_the_app_is_a_json_4xx(key, auth, path):
    headers = {} if auth is None else {"authorization": auth}
    status, err = websocket_refusal(app_for(api_key=key), path, headers)
    if key is not None and auth is None and path != "/health":
        assert (status, err["code"]) == (401, "invalid_api_key")
    else:
        assert (status, err["code"]) == (400, "websocket_not_supported")
    assert "Traceback" not in err["message"]


@pytest.mark.parametrize("path", ["/-/routes", "/-/healthz", "/v1/models"])
def test_without_a_key_the_proxy_guard_still_refuses_websockets_and_passes_http(path):
    from pipeline.frontend.proxy_guard import CALLBACK_ENV, SystemRoutesGuard, proxy_guard_env

    assert CALLBACK_ENV in proxy_guard_env("")  # installed with no key too
    reached = []

    async def serve_proxy(scope: dict, receive: Any, send: Any) -> None:
        reached.append(scope["type"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    status, err = websocket_refusal(SystemRoutesGuard(serve_proxy, api_key=""), path, {})
    assert (status, err["code"]) == (400, "websocket_not_supported")
    assert reached == []
    transport = httpx.ASGITransport(app=SystemRoutesGuard(serve_proxy, api_key=""))

    async def get() -> int:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return (await c.get(path)).status_code

    assert asyncio.run(get()) == 200 and reached == ["http"]
