"""OutputProcessor with traces: one `spec.request` span per request, one `spec.verify_step` span per
step, and a `spec.finish` event on the step that finished each request (DESIGN.md, *Traces*).

Span and attribute names are DESIGN's. Added here (documented for `specrelay trace` and dashboards):

- On `spec.verify_step`, per-request arrays aligned with `spec.request.ids` (the step's request ids,
  in message order): `spec.request.drafted` (drafts proposed), `spec.request.accepted` (raw
  acceptance, len - 1), `spec.request.retained` (tokens kept in the output: the whole window, the
  part up to the finish position, or 0 for a dropped request). One attribute per step, not one
  event per request, keeps the cost per step flat.
- `finish.matched` is always a string: the stop string itself, or a stop token id in decimal.
  `finish.matched_kind` says which ("string" or "token_id") so a reader can give back the exact
  `matched_stop`. Both are omitted when nothing was matched (length, abort).

Cost: the step span's attributes are built once per step from the message's arrays; per request we
only do a dict lookup and keep a counter; nothing is per token. When the step span is not sampled
(the verifier's traceparent came unsampled, or the ratio said no) no attribute or event is built.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from pipeline.params import SamplingParams
from pipeline.protocol import StepColumns, decode_columns
from pipeline.request_output import RequestOutput
from pipeline.tracing import context_from_traceparent, get_tracer, traceparent_of

REQUEST_SPAN = "spec.request"
STEP_SPAN = "spec.verify_step"
FINISH_EVENT = "spec.finish"


@dataclass
class _Live:
    """A traced request between add_request and finish/abort."""

    span: trace.Span
    link: Link | None  # None when the request span is not sampled: nothing to link to
    retained: int = 0  # output tokens retained so far, including the current step's window
    last_n: int = 0  # window length in the step being processed
    last_i: int = 0  # index in that step's message


def matched_attributes(matched: int | str | None) -> dict[str, Any]:
    """`finish.matched` / `finish.matched_kind` for a RequestOutput.matched_stop (empty for None)."""
    if matched is None:
        return {}
    if isinstance(matched, str):
        return {"finish.matched": matched, "finish.matched_kind": "string"}
    return {"finish.matched": str(int(matched)), "finish.matched_kind": "token_id"}


def matched_from_attributes(attrs: dict[str, Any]) -> int | str | None:
    """Inverse of `matched_attributes`."""
    value = attrs.get("finish.matched")
    if value is None or value == "":
        return None
    if attrs.get("finish.matched_kind") == "token_id":
        return int(value)
    return str(value)


class TracedOutputProcessor:
    """Wraps an OutputProcessor (same public API) and records its steps and finishes as spans.

    `inner` must offer `add_request`, `abort`, `process_columns`; the wrapper decodes each payload
    once and hands the columns on. Outputs are returned unchanged.
    """

    def __init__(self, inner: Any, tracer: trace.Tracer | None = None) -> None:
        self.inner = inner
        self.tracer = tracer if tracer is not None else get_tracer()
        self._live: dict[str, _Live] = {}

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        traceparent: str | None = None,
    ) -> None:
        """Add the request to `inner`, then start its `spec.request` span under `traceparent`
        (e.g. the HTTP server span's). A request `inner` rejects gets no span."""
        self.inner.add_request(rid, prompt_ids, params)
        span = self.tracer.start_span(
            REQUEST_SPAN,
            context=context_from_traceparent(traceparent),
            attributes={"request.id": rid, "request.prompt_tokens": len(prompt_ids)},
        )
        link = Link(span.get_span_context()) if span.is_recording() else None
        self._live[rid] = _Live(span, link)

    def abort(self, rid: str) -> RequestOutput | None:
        out = self.inner.abort(rid)
        live = self._live.pop(rid, None)
        if live is not None:
            attrs: dict[str, Any] = {
                "request.completion_tokens": live.retained,
                "finish.reason": "abort",
            }
            if out is not None:
                attrs["spec.verify_ct"] = out.spec_verify_ct
                attrs["spec.accepted_tokens"] = out.spec_accepted_tokens
            self._end_request(live, attrs)
        return out

    def request_traceparent(self, rid: str) -> str | None:
        """The W3C traceparent of a live request's span (for the engine to pass on), or None."""
        live = self._live.get(rid)
        if live is None or not live.span.get_span_context().is_valid:
            return None
        return traceparent_of(live.span)

    # -- steps ------------------------------------------------------------------------------------

    def process(self, payload: bytes) -> list[RequestOutput]:
        """Decode one VerifyStep message and process it (raises ProtocolError like `inner`)."""
        return self.process_columns(decode_columns(payload))

    def process_columns(self, cols: StepColumns) -> list[RequestOutput]:
        rids = cols.rids
        lengths = cols.lengths.tolist()
        live_map = self._live
        links: list[Link] = []
        for i, (rid, n) in enumerate(zip(rids, lengths)):
            live = live_map.get(rid)
            if live is None:  # dropped by inner: finished, aborted or unknown
                continue
            live.retained += n
            live.last_n = n
            live.last_i = i
            if live.link is not None:
                links.append(live.link)
        span = self.tracer.start_span(
            STEP_SPAN,
            context=context_from_traceparent(cols.traceparent),
            kind=SpanKind.CONSUMER,
            links=links,
        )
        recording = span.is_recording()
        try:
            outs = self.inner.process_columns(cols)
        except Exception as e:
            self._undo(rids, lengths)
            if recording:
                span.record_exception(e)
                span.set_status(Status(StatusCode.ERROR, str(e)))
            span.end()
            raise
        retained = self._finish(cols, outs, span if recording else None, lengths)
        if recording:
            accepted = (cols.lengths - 1).tolist()  # raw: len <= drafted + 1, so 0 for a prefill
            span.set_attributes(
                {
                    "spec.step": cols.step,
                    "spec.batch_size": len(rids),
                    "spec.drafted_tokens": int(cols.drafted.sum()),
                    "spec.accepted_tokens": sum(accepted),
                    "spec.request.ids": rids,
                    "spec.request.drafted": cols.drafted.tolist(),
                    "spec.request.accepted": accepted,
                    "spec.request.retained": retained,
                }
            )
        span.end()
        return outs

    def _finish(
        self,
        cols: StepColumns,
        outs: Iterable[RequestOutput],
        span: trace.Span | None,
        lengths: list[int],
    ) -> list[int] | None:
        """End the request spans of requests this step finished; add their `spec.finish` events to
        `span` (None when not recording). Returns the per-request retained counts when recording."""
        retained: list[int] | None = None
        if span is not None:
            live_map = self._live
            retained = [n if rid in live_map else 0 for rid, n in zip(cols.rids, lengths)]
        for out in outs:
            if not out.finished:
                continue
            live = self._live.pop(out.rid, None)
            if live is None:
                continue
            finished_len = out.finished_len if out.finished_len is not None else live.retained
            before = live.retained - live.last_n  # retained before this step
            kept = finished_len - before
            live.retained = finished_len
            matched = matched_attributes(out.matched_stop)
            if span is not None:
                retained[live.last_i] = kept
                span.add_event(
                    FINISH_EVENT,
                    {
                        "request.id": out.rid,
                        "finish.reason": out.finish_reason or "",
                        **matched,
                        "finish.len": finished_len,
                        "finish.window_position": kept - 1,
                    },
                )
            attrs = {
                "request.completion_tokens": finished_len,
                "finish.reason": out.finish_reason or "",
                **matched,
                "spec.verify_ct": out.spec_verify_ct,
                "spec.accepted_tokens": out.spec_accepted_tokens,
            }
            attrs["finish.step"] = out.finish_step if out.finish_step is not None else cols.step
            self._end_request(live, attrs)
        return retained

    def _undo(self, rids: list[str], lengths: list[int]) -> None:
        """inner rejected the step and changed nothing: take back the provisional counts."""
        for rid, n in zip(rids, lengths):
            live = self._live.get(rid)
            if live is not None:
                live.retained -= n

    @staticmethod
    def _end_request(live: _Live, attrs: dict[str, Any]) -> None:
        if live.span.is_recording():
            live.span.set_attributes(attrs)
        live.span.end()

    def __getattr__(self, name: str) -> Any:
        # Anything else (stats, counters of dropped steps) reads through to the wrapped processor.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
