"""Spans for the output path, built as finished ReadableSpans in one go (`SpanRecorder`).

Why not `tracer.start_span`: the SDK validates every attribute value element by element and
rebuilds an attribute set for every link, about 1.5 us per request per step for a step span that
links a 256-request batch -- 30% of the output processor's own time. Set-up, exporters and the
traceparent helpers are pipeline.tracing.otel's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Decision, ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from pipeline.tracing.otel import TRACER_NAME, context_from_traceparent, parent_from_traceparent

_UNSET = Status()  # immutable; shared by every span that ends without an error
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_RECORD_AND_SAMPLE, _RECORD_ONLY = Decision.RECORD_AND_SAMPLE, Decision.RECORD_ONLY
_FOLLOWS_REMOTE = (f"remoteParentSampled:{ALWAYS_ON.get_description()},"
                   f"remoteParentNotSampled:{ALWAYS_OFF.get_description()},")


@dataclass(slots=True)
class OpenSpan:
    """A span started by SpanRecorder: its identity and start time; nothing else is kept."""

    name: str
    context: SpanContext
    parent: SpanContext | None
    kind: SpanKind
    start_ns: int
    recording: bool

    def traceparent(self) -> str:
        return f"00-{self.context.trace_id:032x}-{self.context.span_id:016x}-{self.context.trace_flags:02x}"


class SpanRecorder:
    """Spans for the output path, built as finished ReadableSpans in one go.

    A span is decided at start (the tracer's own sampler and id generator, so sampling and ids
    are the SDK's) and assembled at end from values the caller guarantees well-typed (str, int,
    float, bool, or tuples of one of them), then handed to the tracer's span processors (batch,
    export) exactly as an ended SDK span is. Not applied: span limits and processors' `on_start`.

    `tracer` must be an SDK tracer (from a TracerProvider); for anything else (OpenTelemetry's
    no-op or proxy tracer) `enabled` is False and nothing is recorded.
    """

    def __init__(self, tracer: trace.Tracer, scope: str = TRACER_NAME) -> None:
        self.enabled = isinstance(tracer, SdkTracer)
        self._tracer = tracer
        # An SDK tracer keeps its provider's sampler and id generator for life.
        self._sampler = getattr(tracer, "sampler", None)
        self._ids = getattr(tracer, "id_generator", None)
        # ParentBased with its default remote-parent samplers (as `make_provider` builds it): a
        # remote parent's sampled flag alone decides its children, as on/off samplers would.
        self._follows_remote = isinstance(self._sampler, ParentBased) and (
            _FOLLOWS_REMOTE in self._sampler.get_description())
        self._scope = InstrumentationScope(scope)

    def start(
        self,
        name: str,
        parent: context_api.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        links: Sequence[Link] = (),
    ) -> OpenSpan | None:
        """Decide and identify a span (None when the recorder is disabled)."""
        if not self.enabled:
            return None
        parent_ctx = None
        if parent:
            parent_ctx = trace.get_current_span(parent).get_span_context()
            if not parent_ctx.is_valid:
                parent_ctx = None
        ids = self._ids
        trace_id = parent_ctx.trace_id if parent_ctx is not None else ids.generate_trace_id()
        result = self._sampler.should_sample(parent, trace_id, name, kind, None, links)
        decision = result.decision
        sampled = decision is _RECORD_AND_SAMPLE
        ctx = SpanContext(trace_id, ids.generate_span_id(), False,
                          _SAMPLED if sampled else _NOT_SAMPLED, result.trace_state)
        return OpenSpan(name, ctx, parent_ctx, kind, time.time_ns(),
                        sampled or decision is _RECORD_ONLY)

    def start_child(
        self, name: str, traceparent: str | None, kind: SpanKind = SpanKind.INTERNAL
    ) -> OpenSpan | None:
        """`start` under the remote parent `traceparent` names (a trace of its own when None or
        malformed). Same decision, parent and trace state as `start`; under the sampler
        `make_provider` builds (`_follows_remote`), read off the parent's flag without building
        a Context for the sampler to read it from."""
        if not self._follows_remote:
            return self.start(name, context_from_traceparent(traceparent), kind)
        parent = parent_from_traceparent(traceparent)
        if parent is None:
            return self.start(name, context_api.Context(), kind)
        sampled = parent.trace_flags.sampled
        ctx = SpanContext(parent.trace_id, self._ids.generate_span_id(), False,
                          _SAMPLED if sampled else _NOT_SAMPLED, parent.trace_state)
        return OpenSpan(name, ctx, parent, kind, time.time_ns(), sampled)

    def end(
        self,
        span: OpenSpan | None,
        attributes: dict[str, Any],
        events: Sequence[Event] = (),
        links: Sequence[Link] = (),
        error: BaseException | None = None,
    ) -> None:
        """Finish `span` with these attributes, events and links; nothing when not recording."""
        if span is None or not span.recording:
            return
        status = _UNSET
        if error is not None:  # what the SDK's record_exception / set_status would have added
            status = Status(StatusCode.ERROR, f"{type(error).__name__}: {error}")
            exc = {"exception.type": type(error).__name__, "exception.message": str(error)}
            events = (*events, Event("exception", exc))
        self._tracer.span_processor.on_end(
            ReadableSpan(
                name=span.name,
                context=span.context,
                parent=span.parent,
                resource=self._tracer.resource,
                attributes=attributes,
                events=tuple(events),
                links=tuple(links),
                kind=span.kind,
                status=status,
                start_time=span.start_ns,
                end_time=time.time_ns(),
                instrumentation_scope=self._scope,
            )
        )
