"""OpenTelemetry set-up for every specrelay process, and W3C context helpers.

Each actor process calls `setup_tracing(service_name, config)` once at start; later calls return the
same provider (idempotent), so a shell can call it without knowing whether another did. The provider
lives in one module-level slot per process. Under Ray every actor process has its own slot and reads
its own environment, which is what we want: nothing is meant to travel between processes except the
`traceparent` strings carried in messages.

Settings, highest precedence first: the `config` dict, the standard `OTEL_*` environment variables,
the defaults below.

    config key              environment variable                         default
    service_name            OTEL_SERVICE_NAME                            setup_tracing's argument
    exporter                OTEL_TRACES_EXPORTER (otlp|console|file|none) none
    otlp_protocol           OTEL_EXPORTER_OTLP_PROTOCOL (http/protobuf|grpc) http/protobuf
    otlp_traces_endpoint    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT           (full URL, used as given)
    otlp_endpoint           OTEL_EXPORTER_OTLP_ENDPOINT                  http://localhost:4318 (http),
                                                                         http://localhost:4317 (grpc)
    sample_ratio            OTEL_TRACES_SAMPLER_ARG                      1.0
    file                    SPECRELAY_TRACE_FILE                         specrelay-traces.jsonl
    batch                   -                                            True (BatchSpanProcessor)
    max_links / max_events  OTEL_SPAN_LINK_COUNT_LIMIT / _EVENT_COUNT_   4096 (a step links every request)

`OTEL_SDK_DISABLED=true` turns everything into the no-op tracer. The output path's spans are built
by pipeline.tracing.recorder on top of this set-up. The sampler is always
ParentBased(TraceIdRatioBased(ratio)): a span whose parent came in sampled (HTTP header, verifier
message) is recorded, so one trace is never cut in half between processes.
"""

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
# The `tracing:` config keys (the table above, plus `disabled`); anything else is a typo.
CONFIG_KEYS = ("service_name", "exporter", "otlp_protocol", "otlp_traces_endpoint",
               "otlp_endpoint", "sample_ratio", "file", "batch", "max_links", "max_events",
               "disabled")
# Spellings other tools use, with what to write here instead (named in the error).
_HINTS = {"endpoint": "otlp_endpoint", "protocol": "otlp_protocol",
          "otlp-grpc": "exporter: otlp with otlp_protocol: grpc",
          "otlp-http": "exporter: otlp with otlp_protocol: http/protobuf"}

_log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
# The one form specrelay writes (`traceparent_of`, OpenSpan.traceparent): version 00, nothing more.
_TRACEPARENT_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_FLAGS = {"00": TraceFlags(0), "01": TraceFlags(1)}  # the two every traced engine writes


@dataclass(frozen=True)
class TracingConfig:
    """Resolved settings; `resolve_config` builds it from a dict and the environment."""

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


# The one per-process slot: set by setup_tracing, cleared by shutdown_tracing.
_installed: _Installed | None = None


def resolve_config(
    service_name: str,
    config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> TracingConfig:
    """Merge `config`, then the OTEL_* variables of `environ` (default os.environ), then defaults.

    Raises ValueError naming the setting on an unknown exporter/protocol or a bad ratio.
    """
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
    exporter = exporter.split(",")[0].strip()  # the variable may list several; we take the first
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
    """The exporter `cfg` names (None for "none"). OTLP exporters are imported only when used."""
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
    """A fresh provider for `cfg`, exporting to `exporter` (default: `make_exporter(cfg)`).

    Installs nothing globally: tests and benchmarks use this directly with their own exporter.
    """
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
    """Install this process's provider once; later calls return it unchanged.

    With `register_global`, also registers it as OpenTelemetry's global provider (when none was
    registered yet) so library instrumentation in the same process joins the same traces. The
    HTTP front end passes False: Ray Serve instruments its replicas with the global provider, and
    its own server span would then stand beside ours as a second "HTTP server span".
    """
    global _installed
    cfg = resolve_config(service_name, config)
    if _installed is not None:
        if _installed.config != cfg:
            _log.debug("setup_tracing: already set up as %s; ignoring %s", _installed.config, cfg)
        return _installed.provider
    if cfg.disabled or cfg.exporter == "none":
        # Record nothing, not even children of sampled remote parents: with nowhere to send spans,
        # building them would only cost time on the output path.
        provider = TracerProvider(sampler=ALWAYS_OFF)
    else:
        provider = make_provider(cfg)
    if register_global and not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(provider)
    _installed = _Installed(cfg, provider)
    return provider


def get_tracer(name: str = TRACER_NAME) -> trace.Tracer:
    """A tracer from this process's provider; the global (no-op until set) one before setup."""
    if _installed is not None:
        return _installed.provider.get_tracer(name)
    return trace.get_tracer(name)


def flush_tracing(timeout_s: float = 10.0) -> bool:
    """Export every span this process has ended so far (the batch processor holds them for up to
    5 s); call before the process may end: at exit, on SIGTERM, before an actor is killed.
    False when an exporter did not finish in time."""
    if _installed is None:
        return True
    return bool(_installed.provider.force_flush(int(timeout_s * 1000)))


def shutdown_tracing() -> None:
    """Flush and close this process's exporters; a later setup_tracing starts afresh."""
    global _installed
    if _installed is None:
        return
    installed, _installed = _installed, None
    installed.provider.force_flush()
    installed.provider.shutdown()


def traceparent_of(span: trace.Span | None) -> str | None:
    """The W3C `traceparent` of `span`, or None for a missing or invalid (no-op) span context.

    A non-sampled span still has a valid context; its traceparent carries flags 00 so the receiver
    does not record its child either.
    """
    if span is None or not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span, context_api.Context()))
    return carrier.get("traceparent")


def context_from_traceparent(tp: str | None) -> context_api.Context:
    """A Context whose current span is the remote parent `tp` names; empty Context when tp is
    None or malformed (the new span then starts a trace of its own)."""
    parent = parent_from_traceparent(tp)
    if parent is None:
        return context_api.Context()
    return trace.set_span_in_context(trace.NonRecordingSpan(parent), context_api.Context())


def parent_from_traceparent(tp: str | None) -> SpanContext | None:
    """The remote SpanContext `tp` names, as OpenTelemetry's W3C propagator reads it; None when
    tp is None or malformed."""
    if not tp:
        return None
    m = _TRACEPARENT_00.fullmatch(tp)
    if m is None:  # another version, surrounding blanks, or malformed: the propagator decides
        ctx = _PROPAGATOR.extract({"traceparent": tp}, context=context_api.Context())
        parent = trace.get_current_span(ctx).get_span_context()
        return parent if parent.is_valid else None
    # What the propagator builds for this form, without its carrier and header plumbing (a step
    # message parses one per step on the output path).
    trace_id, span_id = int(m[1], 16), int(m[2], 16)
    if not trace_id or not span_id:
        return None
    flags = _FLAGS.get(m[3])
    if flags is None:
        flags = TraceFlags(int(m[3], 16))
    return SpanContext(trace_id, span_id, True, flags)
