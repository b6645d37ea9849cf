"""Span and event names and the read-back rules of the attributes not written as is, shared by
the stages that write spans and `specrelay trace`; docs/contracts.md, *Traces* defines them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

ENGINE_STEP_SPAN = "spec.engine_step"
REQUEST_SPAN = "spec.request"
STEP_SPAN = "spec.verify_step"
FINISH_EVENT = "spec.finish"


def matched_attributes(matched: int | str | None) -> dict[str, Any]:
    """For a RequestOutput.matched_stop."""
    if matched is None:
        return {}
    if isinstance(matched, str):
        return {"finish.matched": matched, "finish.matched_kind": "string"}
    return {"finish.matched": str(int(matched)), "finish.matched_kind": "token_id"}


def matched_from_attributes(attrs: dict[str, Any]) -> int | str | None:
    value = attrs.get("finish.matched")
    if value is None or value == "":
        return None
    if attrs.get("finish.matched_kind") == "token_id":
        return int(value)
    return str(value)


def retained_from_step(attrs: Mapping[str, Any], events: Iterable[Any]) -> list[int | None]:
    """What each request of a `spec.verify_step` span kept, aligned with its `spec.request.ids`
    (None where unknown)."""
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
