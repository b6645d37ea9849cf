"""The spans the output stage makes (pipeline/tracing/ is the set-up, file and reader they go
through): an OutputProcessor with traces, one `spec.request` span per request, one
`spec.verify_step` span per step, and a `spec.finish` event on the step that finished each request
(docs/contracts.md, *Traces*). The names and attributes, and the rules for reading back the ones
not written as is, are pipeline/tracing/schema.py's (shared with `specrelay trace`).

Cost: spans are built by `pipeline.tracing.recorder.SpanRecorder` (the SDK's sampler, ids and
processors, without its per-value validation). Per step: one span, a few C-level passes over the
batch (the arrays; a pointer compare of the inner's request states with the last step's, and the
ids and links only when they or the recorded requests changed; the outputs only when a request
finished or a row was dropped); nothing per token. A step whose span is not sampled builds no
attribute, event or link; a request whose span is not sampled is never linked. Not thread-safe,
like the OutputProcessor it wraps (one output actor, one thread).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import Event
from opentelemetry.trace import Link, SpanKind

from pipeline.output.request_output import RequestOutput
from pipeline.params import SamplingParams
from pipeline.protocol import StepColumns, decode_columns
from pipeline.tracing.otel import context_from_traceparent, get_tracer
from pipeline.tracing.recorder import OpenSpan, SpanRecorder
from pipeline.tracing.schema import FINISH_EVENT, REQUEST_SPAN, STEP_SPAN, matched_attributes

_CONSUMER = SpanKind.CONSUMER  # the step span consumes the verifier's message


@dataclass(slots=True)
class _Live:
    """A request between add_request and finish/abort."""

    span: OpenSpan | None  # None when tracing is off
    prompt_tokens: int
    cached_tokens: int | None = None  # from its first prefill step's `cached` column


class TracedOutputProcessor:
    """Wraps an OutputProcessor (same public API) and records its requests and steps as spans.

    `inner` must offer `add_request`, `abort`, `process_columns`, `num_requests` and `step_rows`
    (pipeline.output.processor.OutputProcessor's); payloads are
    decoded once here and the columns handed on. Outputs are returned unchanged. `tracer` (default:
    this process's, from `setup_tracing`) must come from an SDK TracerProvider; any other tracer
    records nothing.
    """

    def __init__(self, inner: Any, tracer: trace.Tracer | None = None) -> None:
        self.inner = inner
        self.spans = SpanRecorder(tracer if tracer is not None else get_tracer())
        self._live: dict[str, _Live] = {}
        self._links: dict[str, Link] = {}  # requests whose span is recorded -> link to it
        # The last recorded step's ids and links (`_batch`); stale once `_links` changes.
        self._batch_rids: list[str] = []
        self._batch_rows: list[Any] | None = None  # inner's `step_rows` of that step
        self._batch_ids: tuple[str, ...] = ()
        self._batch_links: tuple[Link, ...] = ()
        self._batch_stale = True

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        traceparent: str | None = None,
    ) -> None:
        """Add the request to `inner`, then start its `spec.request` span as a child of
        `traceparent` (e.g. the HTTP server span). A request `inner` rejects gets no span."""
        self.inner.add_request(rid, prompt_ids, params)
        span = self.spans.start(REQUEST_SPAN, context_from_traceparent(traceparent))
        self._live[rid] = _Live(span, len(prompt_ids))
        if span is not None and span.recording:
            self._links[rid] = Link(span.context)
            self._batch_stale = True

    def abort(self, rid: str) -> RequestOutput | None:
        out = self.inner.abort(rid)
        if rid in self._live:
            attrs: dict[str, Any] = {"finish.reason": "abort"}
            if out is not None:
                attrs["request.completion_tokens"] = out.finished_len or 0
                attrs["spec.verify_ct"] = out.spec_verify_ct
                attrs["spec.accepted_tokens"] = out.spec_accepted_tokens
                attrs["spec.draft_tokens"] = out.spec_draft_tokens
            self._end_request(rid, attrs)
        return out

    def reset(self) -> int:
        """Abort every running request (the engine failed them all; their ids may come back):
        their spans end as aborts. Returns how many there were."""
        rids = list(self._live)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def request_traceparent(self, rid: str) -> str | None:
        """W3C traceparent of a running request's span (for spans made about it elsewhere)."""
        live = self._live.get(rid)
        return None if live is None or live.span is None else live.span.traceparent()

    # -- steps ------------------------------------------------------------------------------------

    def process(self, payload: bytes) -> list[RequestOutput]:
        """Decode one VerifyStep message and process it (raises ProtocolError like `inner`)."""
        return self.process_columns(decode_columns(payload))

    def process_columns(self, cols: StepColumns) -> list[RequestOutput]:
        """Process one step through `inner`; record its span, finish events and request ends.

        Relies on the output contract: one delta per running request of the step whose
        `token_ids` are the tokens it retained from this step's window (so the finishing delta's
        length gives the finish's window position), none for a request the step is dropped for.
        """
        rids = cols.rids
        span = self.spans.start_child(STEP_SPAN, cols.traceparent, _CONSUMER)
        recording = span is not None and span.recording
        running = self.inner.num_requests
        try:
            outs = self.inner.process_columns(cols)
        except Exception as e:  # inner changed nothing; neither do we
            self.spans.end(span, {"spec.step": cols.step}, error=e)
            raise
        if cols.cached is not None:  # a step that prefills: its requests' cache hits
            self._note_cached(rids, cols.cached.tolist())
        # A finishing request leaves inner: when none left, no output needs looking at.
        finished = [o for o in outs if o.finished] if self.inner.num_requests != running else ()
        if not recording:
            for out in finished:
                self._end_finished(out, cols.step)
            return outs
        # Links are taken before the requests that finish in this step are ended (below).
        ids, links = self._batch(rids, self.inner.step_rows if len(outs) == len(rids) else None)
        accepted = (cols.lengths - 1).tolist()  # raw: len <= drafted + 1, so 0 for a prefill
        drafted = cols.drafted.tolist()
        attrs = {
            "spec.step": cols.step,
            "spec.batch_size": len(rids),
            "spec.drafted_tokens": sum(drafted),
            "spec.accepted_tokens": int(cols.offsets[-1]) - len(rids),  # sum(accepted)
            "spec.request.ids": ids,
            "spec.request.drafted": tuple(drafted),
            "spec.request.accepted": tuple(accepted),
        }
        if len(outs) != len(rids):  # rows dropped: what each request kept, spelled out
            kept = {out.rid: len(out.token_ids) for out in outs}
            attrs["spec.request.retained"] = tuple(kept.get(rid, 0) for rid in rids)
        events = [Event(FINISH_EVENT, self._end_finished(out, cols.step, len(out.token_ids)))
                  for out in finished]
        self.spans.end(span, attrs, events, links)
        return outs

    def _batch(
        self, rids: list[str], rows: list[Any] | None
    ) -> tuple[tuple[str, ...], tuple[Link, ...]]:
        """The step's request ids as a tuple and its links (to the recorded requests, in step
        order). A decode step usually carries the same requests as the one before: then, unless a
        request span started or ended since, both are the last step's (no lookup per request;
        and the spans waiting for export share one ids tuple, not one copy of the ids each).
        Same requests: `rows` (inner's `step_rows`; None when a row was dropped) holds the same
        state objects as the last step's (compared by identity), else the same ids."""
        same = rows is not None and rows == self._batch_rows or rids == self._batch_rids
        if self._batch_stale or not same:
            self._batch_rids = list(rids)  # a copy: the caller's list may change later
            self._batch_ids = tuple(rids)
            self._batch_links = tuple(filter(None, map(self._links.get, rids)))
            self._batch_stale = False
        self._batch_rows = rows
        return self._batch_ids, self._batch_links

    def _note_cached(self, rids: list[str], cached: list[int]) -> None:
        # A request's first step is its prefill: keep that one (not a preempted one's rerun).
        for rid, n in zip(rids, cached):
            live = self._live.get(rid)
            if live is not None and live.cached_tokens is None:
                live.cached_tokens = n

    def _end_finished(self, out: RequestOutput, step: int, kept: int = 0) -> dict[str, Any]:
        """End the span of a request `step` finished; returns its `spec.finish` event attributes
        (`kept`: tokens it retained from this step's window)."""
        matched = matched_attributes(out.matched_stop)
        reason = out.finish_reason or ""
        self._end_request(
            out.rid,
            {
                "request.completion_tokens": out.finished_len,
                "finish.reason": reason,
                **matched,
                "finish.step": out.finish_step if out.finish_step is not None else step,
                "spec.verify_ct": out.spec_verify_ct,
                "spec.accepted_tokens": out.spec_accepted_tokens,
                "spec.draft_tokens": out.spec_draft_tokens,
            },
        )
        return {
            "request.id": out.rid,
            "finish.reason": reason,
            **matched,
            "finish.len": out.finished_len,
            "finish.window_position": kept - 1,
        }

    def _end_request(self, rid: str, attrs: dict[str, Any]) -> None:
        live = self._live.pop(rid, None)
        link = self._links.pop(rid, None)
        if link is None or live is None:  # not recorded
            return
        self._batch_stale = True
        head = {"request.id": rid, "request.prompt_tokens": live.prompt_tokens}
        if live.cached_tokens is not None:
            head["request.cached_tokens"] = live.cached_tokens
        self.spans.end(live.span, {**head, **attrs})

    def __getattr__(self, name: str) -> Any:
        # Anything else (num_requests, dropped_steps, get_state) reads through to the wrapped one.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
