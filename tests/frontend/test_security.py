"""Security of the front end and the wire, without Ray: the API key on every route, size limits,
hostile request values (each a 4xx with the server still serving), schema fuzzing of the
served OpenAPI document (never a 5xx), msgpack limits, and no unpickling anywhere.

The same hostile requests run against the real Serve app in test_reliability.py.
"""

from __future__ import annotations

import ast
import asyncio
import json
import time

import httpx
import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.core.parameters import ParameterLocation
from schemathesis.generation import GenerationMode
from support.hostile_requests import BAD_REQUESTS, CHAT, C, check_error, encode_body
from support.paths import REPO as ROOT
from support.server_fakes import ByteTok, FakeEngine

from pipeline import protocol
from pipeline.frontend import responses as resp
from pipeline.frontend.app import ROUTES, ServerSettings, create_app
from pipeline.frontend.openapi import openapi_schema
from pipeline.protocol import verify_step

pytestmark = pytest.mark.timeout(300)

KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OK_BODY = {"prompt": "hi", "max_tokens": 4}


def app_for(engine: FakeEngine | None = None, **settings_kw):
    settings_kw.setdefault("api_key", KEY)
    return create_app(engine or FakeEngine(), ByteTok(), ServerSettings(**settings_kw))


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             timeout=30)


# --------------------------------------------------------------------------- hostile requests

@pytest.mark.parametrize(("name", "path", "body", "status"), BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_hostile_request_is_a_4xx_and_the_server_keeps_serving(name, path, body, status):
    engine = FakeEngine()
    limit = (1 << 20) if "larger body limit" not in name else (2 << 20)
    app = app_for(engine, max_body_bytes=limit)

    async def main():
        async with client(app) as c:
            r = await c.post(path, content=encode_body(body),
                             headers={**AUTH, "content-type": "application/json"})
            ok = await c.post(C, json=OK_BODY, headers=AUTH)
            return r, ok

    t0 = time.monotonic()
    r, ok = asyncio.run(main())
    check_error(r, {status})
    assert time.monotonic() - t0 < 20
    assert engine.running == set()  # nothing was left queued by the refused request
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "Hell"


def test_100_kb_of_headers_is_431_and_a_body_without_length_is_still_capped():
    app = app_for()

    async def chunks():
        for _ in range(40):
            yield b"x" * (64 << 10)  # 2.5 MB with no Content-Length

    async def main():
        async with client(app) as c:
            big = {f"x-h{i}": "v" * 1000 for i in range(100)}
            r1 = await c.post(C, json=OK_BODY, headers={**AUTH, **big})
            r2 = await c.post(C, content=chunks(), headers=AUTH)
            ok = await c.post(C, json=OK_BODY, headers=AUTH)
            return r1, r2, ok

    r1, r2, ok = asyncio.run(main())
    check_error(r1, {431})
    check_error(r2, {413})
    assert ok.status_code == 200


# --------------------------------------------------------------------------- the API key


def served_routes(app) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def test_every_route_but_health_needs_the_key():
    app = app_for()
    routes = served_routes(app)
    assert {p for _, p in routes} == set(ROUTES)  # the list below covers every route
    probes = [*routes, ("GET", "/nope"), ("POST", "/v1/embeddings"), ("GET", "/v1/models/x")]

    async def main():
        out = []
        async with client(app) as c:
            for method, path in probes:
                for headers in ({}, {"Authorization": "Bearer wrong"},
                                {"Authorization": f"Basic {KEY}"},
                                {"Authorization": f"Bearer {KEY}x"},
                                {"Authorization": f"Bearer {KEY[:-1]}"}):
                    r = await c.request(method, path, headers=headers, json=OK_BODY)
                    out.append((method, path, headers, r.status_code))
            health = await c.get("/health")
            models = await c.get("/v1/models", headers=AUTH)
        return out, health, models

    out, health, models = asyncio.run(main())
    for method, path, headers, status in out:
        if path == "/health":
            assert status == 200, (method, path, headers)
        else:
            assert status == 401, (method, path, headers, status)
    assert health.status_code == 200 and models.status_code == 200


def test_key_compare_is_constant_time():
    """The guard compares with hmac.compare_digest and never with == on the key."""
    tree = ast.parse((ROOT / "pipeline" / "frontend" / "guard.py").read_text())
    guard = next(n for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef) and n.name == "key_refusal")
    src = ast.unparse(guard)
    assert "hmac.compare_digest(given, key)" in src
    for node in ast.walk(guard):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq))
                                                 for op in node.ops):
            names = {ast.unparse(x) for x in [node.left, *node.comparators]}
            assert not names & {"key", "given"}, ast.unparse(node)


# --------------------------------------------------------------------------- no unpickling

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve",
                  "joblib", "jsonpickle"}
UNSAFE_ATTRS = {"loads", "load", "Unpickler"}


def unsafe_deserialization(source: str) -> list[str]:
    """Imports of pickle-like modules and calls that unpickle (pickle.loads, ray.cloudpickle,
    torch.load without weights_only=True, numpy.load(allow_pickle=True))."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[-1] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[-1] in UNSAFE_MODULES or any(
                    a.name in UNSAFE_MODULES for a in node.names):
                found.append(f"from {mod} import ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func.value).split(".")[-1]
            attr = node.func.attr
            kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if target in UNSAFE_MODULES and attr in UNSAFE_ATTRS:
                found.append(ast.unparse(node.func))
            elif target == "torch" and attr == "load" and kw.get("weights_only") != "True":
                found.append("torch.load without weights_only=True")
            elif attr == "load" and kw.get("allow_pickle") == "True":
                found.append("load(allow_pickle=True)")
    return found


def test_the_scanner_finds_unpickling():
    assert unsafe_deserialization("import pickle\npickle.loads(b'')") == ["pickle", "pickle.loads"]
    assert unsafe_deserialization("from ray import cloudpickle") == ["from ray import ..."]
    assert unsafe_deserialization("import torch\ntorch.load(f)") == [
        "torch.load without weights_only=True"]
    assert unsafe_deserialization("np.load(f, allow_pickle=True)") == ["load(allow_pickle=True)"]
    assert unsafe_deserialization("torch.load(f, weights_only=True)\njson.loads(s)") == []


def test_no_code_in_pipeline_or_actors_unpickles():
    files = sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "actors").rglob("*.py")])
    assert len(files) > 20
    bad = {str(f.relative_to(ROOT)): hits for f in files
           if (hits := unsafe_deserialization(f.read_text()))}
    assert bad == {}


# --------------------------------------------------------------------------- msgpack limits


def valid_payload() -> bytes:
    return protocol.encode(protocol.VerifyStep(step=3, rids=["a", "b"], token_ids=[[1, 2], [5]],
                                               drafted=[2, 0], logprobs=[[-0.5, -1.0], [-2.0]]))


def raises_protocol_error_fast(payload) -> None:
    t0 = time.monotonic()
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(payload)
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("payload", [
    b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 G elements
    b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 G pairs
    b"\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GB
    b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GB
    b"\xc9\xff\xff\xff\xff\x05",  # ext32
    b"\x91" * 100_000 + b"\xc0",  # 100k nested arrays
    b"\x81\xa1v" * 50_000 + b"\x01",  # 50k nested maps
    msgpack.packb({"v": 1, "x": msgpack.ExtType(1, b"evil")}),
    msgpack.packb({1: 2}),  # non-string map key
], ids=["array-bomb", "map-bomb", "bin-bomb", "str-bomb", "ext", "deep-arrays", "deep-maps",
        "ext-type", "int-key"])
def test_msgpack_bombs_and_foreign_types_are_rejected_quickly(payload):
    raises_protocol_error_fast(payload)


def test_oversized_payload_is_rejected_before_parsing():
    raises_protocol_error_fast(valid_payload() + b"\x00" * protocol.MAX_PAYLOAD_BYTES)


def test_batch_and_request_id_limits():
    base = msgpack.unpackb(valid_payload())

    def with_(**changes) -> bytes:
        return msgpack.packb({**base, **changes}, use_bin_type=True)

    b = protocol.MAX_BATCH + 1
    ones = (b"\x01\x00\x00\x00") * b
    raises_protocol_error_fast(with_(rids=[f"r{i}" for i in range(b)], len=ones,
                                     draft=b"\x00" * 4 * b, tok=b"\x01\x00\x00\x00" * b,
                                     lp=None))
    raises_protocol_error_fast(with_(rids=["a" * (protocol.MAX_RID_CHARS + 1), "b"]))
    raises_protocol_error_fast(with_(rids=["a", 7]))
    raises_protocol_error_fast(with_(step=-1))
    raises_protocol_error_fast(with_(step=1.5))
    raises_protocol_error_fast(with_(v=2))
    raises_protocol_error_fast(with_(extra=1))
    assert protocol.decode(with_()).rids == ["a", "b"]  # the unmutated message is fine


MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=6),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(verify_step.COLUMNS.keys)), MSGPACK_VALUES,
                       max_size=12))
def test_arbitrary_msgpack_maps_decode_or_raise_protocol_error(msg):
    # Keys drawn from the real schema, values of any msgpack type: either a valid step or a
    # ProtocolError, never another exception and never a half-built step.
    try:
        step = protocol.decode(msgpack.packb(msg, use_bin_type=True))
    except protocol.ProtocolError:
        return
    assert protocol.decode(protocol.encode(step)) == step


# --------------------------------------------------------------------------- schema fuzzing


def test_openapi_document_is_served_behind_the_key_and_loads():
    app = app_for()

    async def main():
        async with client(app) as c:
            return await c.get("/openapi.json"), await c.get("/openapi.json", headers=AUTH)

    denied, doc = asyncio.run(main())
    assert denied.status_code == 401 and doc.status_code == 200
    schema = schemathesis.openapi.from_dict(doc.json())
    labels = {op.ok().label for op in schema.get_all_operations()}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"} <= labels


FUZZ_EXAMPLES = 80  # per route and mode: ~10 s in all
FUZZ_SCHEMA = schemathesis.openapi.from_dict(openapi_schema())
FUZZ_APP = app_for(FakeEngine(num_slots=64, max_waiting=10_000), max_body_bytes=1 << 20)


def call_case(case) -> httpx.Response:
    body = case.body
    headers = {**AUTH, "content-type": "application/json"}
    if isinstance(body, (dict, list)) or body is None or isinstance(body, (int, float, bool)):
        try:
            content = json.dumps(body, allow_nan=True).encode()
        except (TypeError, ValueError):
            content = repr(body).encode()
    elif isinstance(body, str):
        content = body.encode("utf-8", "surrogatepass")
    else:
        content = bytes(body)

    async def main():
        async with client(FUZZ_APP) as c:
            return await c.request(case.method, case.path, content=content, headers=headers)

    return asyncio.run(main())


def check_fuzz_response(r: httpx.Response, mode: GenerationMode) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        check_error(r, {400, 404, 413})
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        body = r.json()
        assert body["choices"] and all(c["finish_reason"] for c in body["choices"])


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["positive", "negative"])
@pytest.mark.parametrize("path", [C, CHAT])
def test_schema_fuzzing_never_gets_a_server_error(path, mode):
    op = FUZZ_SCHEMA[path]["POST"]
    seen: list[int] = []

    @settings(max_examples=int(FUZZ_EXAMPLES), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        r = call_case(case)
        check_fuzz_response(r, mode)
        # Negative cases may break only a header (we send our own); a broken body is refused.
        if body_mode(case) is GenerationMode.NEGATIVE:
            assert 400 <= r.status_code < 500, (case.body, r.status_code)
        seen.append((body_mode(case), r.status_code))

    run()
    if mode is GenerationMode.NEGATIVE:
        assert sum(m is GenerationMode.NEGATIVE for m, _ in seen) >= len(seen) // 4
    else:
        assert any(s == 200 for _, s in seen), seen  # schema-valid requests are served


def body_mode(case) -> GenerationMode | None:
    info = case.meta.components.get(ParameterLocation.BODY) if case.meta else None
    return info.mode if info else None


def test_non_finite_logprobs_render_as_finite_numbers():
    # Responses are JSON with allow_nan=False: -inf/NaN logprobs (masked tokens) become -9999.0.
    lp = resp.completion_logprobs([1], [float("-inf")], [[(1, float("nan"))]], str)
    assert lp["token_logprobs"] == [-9999.0] and lp["top_logprobs"] == [{"1": -9999.0}]
    chat = resp.chat_logprobs([1], [float("nan")], [[(2, float("-inf"))]], str)
    assert chat["content"][0]["logprob"] == -9999.0
    assert chat["content"][0]["top_logprobs"][0]["logprob"] == -9999.0
    json.dumps([lp, chat], allow_nan=False)
