"""The trace schema: the names of specrelay's spans and events and the rules for the attributes
that are not written as is, in one place for the stages that write them (the output stage:
pipeline/output/spans.py; the engine: pipeline/engine/core.py, pipeline/engine/spec/record.py)
and the reader (`specrelay trace`, pipeline/tracing/cli.py). Plain data and functions, no
OpenTelemetry.

Span and attribute names are those of docs/contracts.md, *Traces*; these, in detail (for
`specrelay trace` and dashboards):

- On `spec.verify_step`, per-request arrays aligned with `spec.request.ids` (the step's request ids,
  in message order): `spec.request.drafted` (drafts proposed), `spec.request.accepted` (raw
  acceptance, len - 1). What each request kept in the output is its whole window (accepted + 1),
  but for a request the step finished (`finish.window_position` + 1 of its `spec.finish` event);
  only a step that was dropped for some of its requests (unknown or already finished ones, a stale
  step) spells it out as `spec.request.retained` (0 for those). One attribute per step, not one
  event per request, keeps the cost per step flat, and what can be derived is not written.
- On the engine's `spec.engine_step` span (the parent of `spec.verify_step`; pipeline.engine.core),
  why each request's k was chosen, for sampled steps only (pipeline.engine.spec.record): arrays
  aligned with its own `spec.request.ids` (same message order: prefills, then decodes):
  `spec.control.k` (drafts asked for), `spec.control.cap` (the most allowed), `spec.control.why`
  (`plan`, `probe`, `explore`, `pinned` or `prefill`), and where the plan used estimates
  `spec.control.acceptance` (estimated acceptance of the next draft), `spec.control.gain`
  (expected extra tokens of the drafts asked for), `spec.control.next_gain` (of one more draft),
  `spec.control.offered` (how often the proposer had a draft when asked); per step
  `spec.control.plan` (`rate`, `drain`, `fixed` or `off`: nothing measured at this batch yet),
  `spec.control.cost.{base_s,per_row_s,per_draft_s,per_verify_s}` (the step-cost model),
  `spec.control.step_s` (predicted seconds of the step), `spec.control.floor` (gain a verify row
  must bring to pay) and `spec.control.rate` (the plan's expected tokens per second).
- On `spec.request`, `request.cached_tokens`: prompt tokens whose KV came from the prefix cache
  at the request's first prefill (the step message's optional `ch` column; absent when the
  request never reached a step).
- `finish.matched` is always a string: the stop string itself, or a stop token id in decimal.
  `finish.matched_kind` says which ("string" or "token_id") so a reader can give back the exact
  `matched_stop`. Both are omitted when nothing was matched (length, abort).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

ENGINE_STEP_SPAN = "spec.engine_step"
REQUEST_SPAN = "spec.request"
STEP_SPAN = "spec.verify_step"
FINISH_EVENT = "spec.finish"


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


def retained_from_step(attrs: Mapping[str, Any], events: Iterable[Any]) -> list[int | None]:
    """What each request of a `spec.verify_step` span kept in the output, aligned with its
    `spec.request.ids` (None where its acceptance is unknown): the inverse of what
    `TracedOutputProcessor` (pipeline/output/spans.py) writes. `events` are the span's events
    (anything with `name` and `attributes`)."""
    retained = attrs.get("spec.request.retained")
    if retained is not None:
        return list(retained)
    kept = {}
    for ev in events:
        position = ev.attributes.get("finish.window_position")
        if ev.name == FINISH_EVENT and position is not None:
            kept[str(ev.attributes.get("request.id"))] = int(position) + 1
    ids = attrs.get("spec.request.ids") or ()
    accepted = attrs.get("spec.request.accepted") or [None] * len(ids)
    return [kept.get(str(rid), None if a is None else a + 1) for rid, a in zip(ids, accepted)]
