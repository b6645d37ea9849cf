"""The output stage's spans (docs/contracts.md, *Traces*): one `spec.request` per request, one
`spec.verify_step` per step, a `spec.finish` event on the step that finished a request. Per
step: one span and a few C-level passes, nothing per token."""

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

_CONSUMER = SpanKind.CONSUMER


@dataclass(slots=True)
class _Live:
    span: OpenSpan | None
    prompt_tokens: int
    cached_tokens: int | None = None


class TracedOutputProcessor:
    """An OutputProcessor's API over `inner`, recording its requests and steps as spans.
    `tracer` must come from an SDK TracerProvider; any other records nothing."""

    def __init__(self, inner: Any, tracer: trace.Tracer | None = None) -> None:
        self.inner = inner
        self.spans = SpanRecorder(tracer if tracer is not None else get_tracer())
        self._live: dict[str, _Live] = {}
        self._links: dict[str, Link] = {}
        # The last recorded step's ids and links (`_batch`); stale once `_links` changes.
        self._batch_rids: list[str] = []
        self._batch_rows: list[Any] | None = None
        self._batch_ids: tuple[str, ...] = ()
        self._batch_links: tuple[Link, ...] = ()
        self._batch_stale = True

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        traceparent: str | None = None,
    ) -> None:
        """A request `inner` rejects gets no span."""
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
        """Abort every running request (the engine failed them all; their ids may come back)."""
        rids = list(self._live)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def request_traceparent(self, rid: str) -> str | None:
        live = self._live.get(rid)
        return None if live is None or live.span is None else live.span.traceparent()

    def process(self, payload: bytes) -> list[RequestOutput]:
        return self.process_columns(decode_columns(payload))

    def process_columns(self, cols: StepColumns) -> list[RequestOutput]:
        """Relies on the output contract: one delta per running request of the step, its
        `token_ids` what it retained of this step's window; none where the row was dropped."""
        rids = cols.rids
        span = self.spans.start_child(STEP_SPAN, cols.traceparent, _CONSUMER)
        recording = span is not None and span.recording
        running = self.inner.num_requests
        try:
            outs = self.inner.process_columns(cols)
        except Exception as e:  # inner changed nothing; neither do we
            self.spans.end(span, {"spec.step": cols.step}, error=e)
            raise
        if cols.cached is not None:
            self._note_cached(rids, cols.cached.tolist())
        # A finishing request leaves inner: when none left, no output needs looking at.
        finished = [o for o in outs if o.finished] if self.inner.num_requests != running else ()
        if not recording:
            for out in finished:
                self._end_finished(out, cols.step)
            return outs
        # Links are taken before the requests that finish in this step are ended (below).
        ids, links = self._batch(rids, self.inner.step_rows if len(outs) == len(rids) else None)
        accepted = (cols.lengths - 1).tolist()  # raw, before finish truncation
        drafted = cols.drafted.tolist()
        attrs = {
            "spec.step": cols.step,
            "spec.batch_size": len(rids),
            "spec.drafted_tokens": sum(drafted),
            "spec.accepted_tokens": int(cols.offsets[-1]) - len(rids),
            "spec.request.ids": ids,
            "spec.request.drafted": tuple(drafted),
            "spec.request.accepted": tuple(accepted),
        }
        if len(outs) != len(rids):
            kept = {out.rid: len(out.token_ids) for out in outs}
            attrs["spec.request.retained"] = tuple(kept.get(rid, 0) for rid in rids)
        events = [Event(FINISH_EVENT, self._end_finished(out, cols.step, len(out.token_ids)))
                  for out in finished]
        self.spans.end(span, attrs, events, links)
        return outs

    def _batch(
        self, rids: list[str], rows: list[Any] | None
    ) -> tuple[tuple[str, ...], tuple[Link, ...]]:
        """The last step's ids and links again while the requests stay the same (the same `rows`
        objects, or ids): no lookup per request, and queued spans share one ids tuple."""
        same = rows is not None and rows == self._batch_rows or rids == self._batch_rids
        if self._batch_stale or not same:
            self._batch_rids = list(rids)
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
        if link is None or live is None:
            return
        self._batch_stale = True
        head = {"request.id": rid, "request.prompt_tokens": live.prompt_tokens}
        if live.cached_tokens is not None:
            head["request.cached_tokens"] = live.cached_tokens
        self.spans.end(live.span, {**head, **attrs})

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
