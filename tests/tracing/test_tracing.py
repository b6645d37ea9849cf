"""pipeline.tracing.otel set-up and exporters: OTLP over HTTP and gRPC reach a receiver, the JSON-lines
file is the OTLP/JSON encoding, and a traceparent crosses a real process boundary."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from google.protobuf.json_format import ParseDict
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.paths import ROOT as REPO

from pipeline.tracing.otel import (
    context_from_traceparent,
    make_exporter,
    make_provider,
    resolve_config,
    traceparent_of,
)
from pipeline.tracing.trace_file import JsonLinesSpanExporter, read_spans, spans_to_otlp_json


def span_names(req: ExportTraceServiceRequest) -> list[str]:
    return [s.name for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


# ------------------------------------------------------------------------------------ config


def test_config_dict_wins_over_environment_and_defaults_fill_in():
    env = {
        "OTEL_SERVICE_NAME": "from-env",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "SPECRELAY_TRACE_FILE": "/tmp/x.jsonl",
    }
    cfg = resolve_config("output", None, environ=env)
    assert (cfg.service_name, cfg.exporter, cfg.otlp_protocol) == ("from-env", "otlp", "grpc")
    assert (cfg.otlp_endpoint, cfg.sample_ratio, cfg.file) == (
        "http://collector:4317",
        0.25,
        "/tmp/x.jsonl",
    )
    cfg = resolve_config("output", {"exporter": "file", "sample_ratio": 1.0}, environ=env)
    assert (cfg.exporter, cfg.sample_ratio, cfg.service_name) == ("file", 1.0, "from-env")
    cfg = resolve_config("output", None, environ={})
    assert (cfg.service_name, cfg.exporter, cfg.sample_ratio) == ("output", "none", 1.0)
    assert cfg.otlp_endpoint == "http://localhost:4318/v1/traces"


def test_http_endpoint_gets_signal_path_and_traces_endpoint_is_used_as_given():
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}
    assert resolve_config("s", None, base).otlp_endpoint == "http://c:4318/v1/traces"
    full = {**base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/custom"}
    assert resolve_config("s", None, full).otlp_endpoint == "http://t:9/custom"


@pytest.mark.parametrize(
    "env, field",
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG"),
        ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"),
    ],
)
def test_bad_settings_raise_naming_the_setting(env, field):
    with pytest.raises(ValueError, match=field):
        resolve_config("s", None, environ=env)


def test_make_exporter_picks_the_named_exporter(tmp_path):
    def exp(**cfg):
        return make_exporter(resolve_config("s", cfg, environ={}))

    assert exp(exporter="none") is None
    assert isinstance(exp(exporter="console"), ConsoleSpanExporter)
    assert isinstance(exp(exporter="file", file=str(tmp_path / "t.jsonl")), JsonLinesSpanExporter)
    grpc_exp = exp(exporter="otlp", otlp_protocol="grpc")
    assert type(grpc_exp).__module__.startswith("opentelemetry.exporter.otlp.proto.grpc")
    grpc_exp.shutdown()


def test_sampling_ratio_zero_records_nothing_and_one_records_all():
    for ratio, expected in ((0.0, 0), (1.0, 50)):
        mem = InMemorySpanExporter()
        cfg = resolve_config("s", {"sample_ratio": ratio, "batch": False}, environ={})
        tracer = make_provider(cfg, mem).get_tracer("t")
        for _ in range(50):
            tracer.start_span("x").end()
        assert len(mem.get_finished_spans()) == expected


# ------------------------------------------------------------------------------------ context


def test_traceparent_round_trip_and_bad_input():
    span = TracerProvider().get_tracer("a").start_span("a")
    tp = traceparent_of(span)
    ctx = span.get_span_context()
    assert tp == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    parent = trace.get_current_span(context_from_traceparent(tp)).get_span_context()
    assert (parent.trace_id, parent.span_id, parent.is_remote) == (ctx.trace_id, ctx.span_id, True)
    for bad in (None, "", "garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01"):
        assert not trace.get_current_span(context_from_traceparent(bad)).get_span_context().is_valid
    assert traceparent_of(None) is None
    assert traceparent_of(trace.INVALID_SPAN) is None


CHILD = """
import sys
from pipeline.tracing.otel import get_tracer, setup_tracing, shutdown_tracing, context_from_traceparent
from pipeline.tracing.otel import traceparent_of
p1 = setup_tracing("verifier")
p2 = setup_tracing("something-else", {"sample_ratio": 0.0})
assert p1 is p2, "setup_tracing must be idempotent"
span = get_tracer().start_span("spec.verify_step", context=context_from_traceparent(sys.argv[1]))
span.end()
print(traceparent_of(span))
shutdown_tracing()
"""


def test_traceparent_crosses_a_real_process_and_env_configures_the_file_exporter(tmp_path):
    parent = TracerProvider().get_tracer("engine").start_span("engine.step")
    path = tmp_path / "child-{pid}.jsonl"
    env = {
        **os.environ,
        "OTEL_TRACES_EXPORTER": "file",
        "SPECRELAY_TRACE_FILE": str(path),
        "OTEL_SERVICE_NAME": "child-svc",
        "PYTHONPATH": REPO,
    }
    res = subprocess.run(
        [sys.executable, "-c", CHILD, traceparent_of(parent)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    (written,) = list(tmp_path.glob("child-*.jsonl"))
    (span,) = read_spans([str(written)])
    pctx = parent.get_span_context()
    assert span.name == "spec.verify_step"
    assert (
        span.trace_id == f"{pctx.trace_id:032x}" and span.parent_span_id == f"{pctx.span_id:016x}"
    )
    assert span.resource["service.name"] == "child-svc"
    assert res.stdout.strip() == f"00-{span.trace_id}-{span.span_id}-03"


# ------------------------------------------------------------------------------------ exporters


def make_spans():
    mem = InMemorySpanExporter()
    tracer = make_provider(resolve_config("svc", {"batch": False}, environ={}), mem).get_tracer("t")
    req = tracer.start_span("spec.request", attributes={"request.id": "r1", "n": 3})
    step = tracer.start_span(
        "spec.verify_step",
        links=[trace.Link(req.get_span_context())],
        attributes={"spec.step": 7, "spec.request.ids": ["r1"], "ratio": 0.5, "ok": True},
    )
    step.add_event("spec.finish", {"request.id": "r1", "finish.len": 4})
    child = tracer.start_span("child", context=trace.set_span_in_context(step))
    for s in (child, step, req):
        s.end()
    return mem.get_finished_spans()


def test_file_line_is_the_protobuf_encoding_with_hex_ids(tmp_path):
    spans = make_spans()
    path = tmp_path / "t.jsonl"
    exporter = JsonLinesSpanExporter(str(path))
    exporter.export(spans)
    exporter.export(spans[:1])
    exporter.shutdown()
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and " " not in lines[0].split('"name"')[0]  # compact, like the Collector
    doc = json.loads(lines[0])
    child = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert child["parentSpanId"] == f"{spans[1].context.span_id:016x}"
    step = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][1]
    assert step["links"][0]["spanId"] == f"{spans[2].context.span_id:016x}"
    attrs = {a["key"]: a["value"] for a in step["attributes"]}
    assert attrs["spec.step"] == {"intValue": "7"}
    assert attrs["spec.request.ids"] == {"arrayValue": {"values": [{"stringValue": "r1"}]}}
    assert attrs["ratio"] == {"doubleValue": 0.5} and attrs["ok"] == {"boolValue": True}
    # Turn the hex ids back into protobuf-JSON base64: the result is exactly the OTLP encoding.
    for rs in doc["resourceSpans"]:
        for sp in rs["scopeSpans"][0]["spans"]:
            for obj in [sp, *sp.get("links", [])]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in obj:
                        obj[key] = base64.b64encode(bytes.fromhex(obj[key])).decode()
    assert ParseDict(doc, ExportTraceServiceRequest()) == encode_spans(spans)


def test_file_reader_round_trips_the_writer(tmp_path):
    spans = make_spans()
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(spans_to_otlp_json(spans)) + "\n")
    recs = {r.name: r for r in read_spans([str(path)])}
    step = recs["spec.verify_step"]
    assert step.attributes == {
        "spec.step": 7,
        "spec.request.ids": ["r1"],
        "ratio": 0.5,
        "ok": True,
    }
    assert step.events[0].attributes == {"request.id": "r1", "finish.len": 4}
    assert step.links[0].span_id == recs["spec.request"].span_id
    assert recs["child"].parent_span_id == step.span_id
    assert step.start_ns == spans[1].start_time and step.resource["service.name"] == "svc"


class _Receiver(BaseHTTPRequestHandler):
    """Keeps (path, content type, body) of every POST in `server.bodies`."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append((self.path, self.headers.get("Content-Type"), body))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_otlp_http_export_reaches_a_receiver():
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
        }
        provider = make_provider(resolve_config("http-svc", None, environ=env))
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span("spec.request"):
            tracer.start_span("spec.verify_step").end()
        assert provider.force_flush(10_000)
        provider.shutdown()
    finally:
        server.shutdown()
    path, ctype, body = server.bodies[0]
    assert (path, ctype) == ("/v1/traces", "application/x-protobuf")
    req = ExportTraceServiceRequest.FromString(body)
    assert sorted(
        n for _, _, b in server.bodies for n in span_names(ExportTraceServiceRequest.FromString(b))
    ) == ["spec.request", "spec.verify_step"]
    res = {a.key: a.value.string_value for a in req.resource_spans[0].resource.attributes}
    assert res["service.name"] == "http-svc"


def test_otlp_grpc_export_reaches_a_receiver():
    import grpc  # installed with opentelemetry-exporter-otlp-proto-grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    got: list[ExportTraceServiceRequest] = []

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            got.append(request)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        }
        provider = make_provider(resolve_config("grpc-svc", None, environ=env))
        provider.get_tracer("t").start_span("spec.verify_step").end()
        assert provider.force_flush(10_000)
        provider.shutdown()
    finally:
        server.stop(None)
    assert [n for r in got for n in span_names(r)] == ["spec.verify_step"]
