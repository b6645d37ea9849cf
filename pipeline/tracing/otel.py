"""OpenTelemetry set-up, once per process, and W3C traceparent helpers. Settings: the `tracing:`
config section, then the standard `OTEL_*` variables of this process, then the defaults
(docs/config.md). Only `traceparent` strings in messages travel between processes; the
ParentBased sampler records a span whose parent came in sampled, so no trace is cut in half."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pipeline.tracing.trace_file import JsonLinesSpanExporter

TRACER_NAME = "specrelay"
EXPORTERS = ("otlp", "console", "file", "none")
PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_TRACE_FILE = "specrelay-traces.jsonl"
DEFAULT_MAX_LINKS = 4096
_DEFAULT_BASE = {"http/protobuf": "http://localhost:4318", "grpc": "http://localhost:4317"}
CONFIG_KEYS = ("service_name", "exporter", "otlp_protocol", "otlp_traces_endpoint",
               "otlp_endpoint", "sample_ratio", "file", "batch", "max_links", "max_events",
               "disabled")
# Other tools' spellings, with what to write here instead.
_HINTS = {"endpoint": "otlp_endpoint", "protocol": "otlp_protocol",
          "otlp-grpc": "exporter: otlp with otlp_protocol: grpc",
          "otlp-http": "exporter: otlp with otlp_protocol: http/protobuf"}

_log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
# The one form specrelay writes.
_TRACEPARENT_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_FLAGS = {"00": TraceFlags(0), "01": TraceFlags(1)}


@dataclass(frozen=True)
class TracingConfig:
    service_name: str
    exporter: str = "none"
    otlp_protocol: str = "http/protobuf"
    otlp_endpoint: str = "http://localhost:4318/v1/traces"
    sample_ratio: float = 1.0
    file: str = DEFAULT_TRACE_FILE
    batch: bool = True
    max_links: int = DEFAULT_MAX_LINKS
    max_events: int = DEFAULT_MAX_LINKS
    disabled: bool = False


@dataclass
class _Installed:
    config: TracingConfig
    provider: TracerProvider


_installed: _Installed | None = None


def resolve_config(
    service_name: str,
    config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> TracingConfig:
    """ValueError naming the setting on an unknown key, exporter or protocol or a bad ratio."""
    cfg = dict(config or {})
    env = os.environ if environ is None else environ
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if unknown:
        hints = "".join(f"; for {k!r} write {_HINTS[k]}" for k in unknown if k in _HINTS)
        raise ValueError(f"unknown key(s) {', '.join(unknown)} (known: {', '.join(CONFIG_KEYS)})"
                         + hints)

    def pick(key: str, var: str | None, default: Any) -> Any:
        if cfg.get(key) is not None:
            return cfg[key]
        if var and env.get(var, "").strip():
            return env[var].strip()
        return default

    exporter = str(pick("exporter", "OTEL_TRACES_EXPORTER", "none")).lower()
    exporter = exporter.split(",")[0].strip()
    if exporter not in EXPORTERS:
        hint = f"; write {_HINTS[exporter]}" if exporter in _HINTS else ""
        raise ValueError(f"exporter / OTEL_TRACES_EXPORTER: {exporter!r} not in {EXPORTERS}{hint}")
    protocol = str(pick("otlp_protocol", "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")).lower()
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"otlp_protocol / OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} not in {PROTOCOLS}"
        )
    endpoint = pick("otlp_traces_endpoint", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    if endpoint is None:
        base = str(pick("otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT", _DEFAULT_BASE[protocol]))
        # The base-URL variable means "append the signal path" for HTTP only (OTLP exporter spec).
        endpoint = base.rstrip("/") + "/v1/traces" if protocol == "http/protobuf" else base
    try:
        ratio = float(pick("sample_ratio", "OTEL_TRACES_SAMPLER_ARG", 1.0))
    except ValueError:
        raise ValueError("sample_ratio / OTEL_TRACES_SAMPLER_ARG: must be a number") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"sample_ratio / OTEL_TRACES_SAMPLER_ARG: must be in [0, 1], got {ratio}")
    disabled = str(pick("disabled", "OTEL_SDK_DISABLED", "false")).lower() in ("true", "1")
    return TracingConfig(
        service_name=str(pick("service_name", "OTEL_SERVICE_NAME", service_name)),
        exporter=exporter,
        otlp_protocol=protocol,
        otlp_endpoint=str(endpoint),
        sample_ratio=ratio,
        file=str(pick("file", "SPECRELAY_TRACE_FILE", DEFAULT_TRACE_FILE)),
        batch=bool(cfg.get("batch", True)),
        max_links=int(pick("max_links", "OTEL_SPAN_LINK_COUNT_LIMIT", DEFAULT_MAX_LINKS)),
        max_events=int(pick("max_events", "OTEL_SPAN_EVENT_COUNT_LIMIT", DEFAULT_MAX_LINKS)),
        disabled=disabled,
    )


def make_exporter(cfg: TracingConfig) -> SpanExporter | None:
    if cfg.exporter == "none":
        return None
    if cfg.exporter == "console":
        return ConsoleSpanExporter(service_name=cfg.service_name)
    if cfg.exporter == "file":
        return JsonLinesSpanExporter(cfg.file)
    if cfg.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        insecure = cfg.otlp_endpoint.startswith("http://")
        return Grpc(endpoint=cfg.otlp_endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(endpoint=cfg.otlp_endpoint)


def make_provider(cfg: TracingConfig, exporter: SpanExporter | None = None) -> TracerProvider:
    """Installs nothing globally: tests and benchmarks pass their own exporter."""
    sampler = ParentBased(TraceIdRatioBased(cfg.sample_ratio))
    # A step span links every request in its batch and carries one event per finished request;
    # the SDK's default of 128 would silently drop some in a large batch.
    limits = SpanLimits(max_links=cfg.max_links, max_events=cfg.max_events)
    provider = TracerProvider(
        sampler=sampler,
        resource=Resource.create({"service.name": cfg.service_name}),
        span_limits=limits,
    )
    exporter = make_exporter(cfg) if exporter is None else exporter
    if exporter is not None:
        processor = BatchSpanProcessor(exporter) if cfg.batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
    return provider


def setup_tracing(
    service_name: str, config: Mapping[str, Any] | None = None, register_global: bool = True
) -> TracerProvider:
    """Install this process's provider once; later calls return it unchanged. The HTTP front end
    passes register_global=False: Ray Serve's instrumentation would use a global provider and
    add a second HTTP server span beside ours."""
    global _installed
    cfg = resolve_config(service_name, config)
    if _installed is not None:
        if _installed.config != cfg:
            _log.debug("setup_tracing: already set up as %s; ignoring %s", _installed.config, cfg)
        return _installed.provider
    if cfg.disabled or cfg.exporter == "none":
        # Not even children of sampled remote parents: with nowhere to send them, spans cost only.
        provider = TracerProvider(sampler=ALWAYS_OFF)
    else:
        provider = make_provider(cfg)
    if register_global and not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(provider)
    _installed = _Installed(cfg, provider)
    return provider


def get_tracer(name: str = TRACER_NAME) -> trace.Tracer:
    if _installed is not None:
        return _installed.provider.get_tracer(name)
    return trace.get_tracer(name)


def flush_tracing(timeout_s: float = 10.0) -> bool:
    """Call before the process may end: the batch processor holds spans for up to 5 s."""
    if _installed is None:
        return True
    return bool(_installed.provider.force_flush(int(timeout_s * 1000)))


def shutdown_tracing() -> None:
    global _installed
    if _installed is None:
        return
    installed, _installed = _installed, None
    installed.provider.force_flush()
    installed.provider.shutdown()


def traceparent_of(span: trace.Span | None) -> str | None:
    """None for a missing or no-op span; a non-sampled span's carries flags 00."""
    if span is None or not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span, context_api.Context()))
    return carrier.get("traceparent")


def context_from_traceparent(tp: str | None) -> context_api.Context:
    parent = parent_from_traceparent(tp)
    if parent is None:
        return context_api.Context()
    return trace.set_span_in_context(trace.NonRecordingSpan(parent), context_api.Context())


def parent_from_traceparent(tp: str | None) -> SpanContext | None:
    """As OpenTelemetry's W3C propagator reads it; None when tp is None or malformed."""
    if not tp:
        return None
    m = _TRACEPARENT_00.fullmatch(tp)
    if m is None:
        ctx = _PROPAGATOR.extract({"traceparent": tp}, context=context_api.Context())
        parent = trace.get_current_span(ctx).get_span_context()
        return parent if parent.is_valid else None
    # The propagator's result without its plumbing: the output path parses one per step.
    trace_id, span_id = int(m[1], 16), int(m[2], 16)
    if not trace_id or not span_id:
        return None
    flags = _FLAGS.get(m[3])
    if flags is None:
        flags = TraceFlags(int(m[3], 16))
    return SpanContext(trace_id, span_id, True, flags)
