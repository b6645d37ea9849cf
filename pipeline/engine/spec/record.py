"""Why a step's k was chosen, as `spec.control.*` span attributes (pipeline/tracing/schema.py),
built only for a step whose span is sampled."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PLANS = ("rate", "drain", "fixed", "off")  # off: nothing measured at this batch size
WHY = ("plan", "probe", "explore", "pinned")


@dataclass
class Decision:
    """`gain`: S_1 + ... + S_k, `next_gain`: S_{k+1}; `next_gain < floor <= S_k` holds for most
    requests, not all (the plan also weighs the longest draft)."""

    plan: str
    rids: list[str]
    caps: list[int]
    ks: list[int]
    why: list[str]
    acceptance: list[float] | None = None
    gain: list[float] | None = None
    next_gain: list[float] | None = None
    offered: list[float] | None = None
    costs: tuple[float, float, float, float] | None = None
    step_s: float | None = None
    floor: float | None = None
    rate: float | None = None


def span_attributes(decision: Decision | None, prefills: list[str]) -> dict[str, Any]:
    """Attributes aligned with `spec.request.ids`: `prefills` (why "prefill"), then decodes."""
    n = len(prefills)
    zeros = (0,) * n
    if decision is None:
        return {"spec.request.ids": tuple(prefills), "spec.control.k": zeros,
                "spec.control.cap": zeros, "spec.control.why": ("prefill",) * n}
    attrs: dict[str, Any] = {
        "spec.request.ids": (*prefills, *decision.rids),
        "spec.control.plan": decision.plan,
        "spec.control.k": (*zeros, *decision.ks),
        "spec.control.cap": (*zeros, *decision.caps),
        "spec.control.why": (*(("prefill",) * n), *decision.why),
    }
    floats = (0.0,) * n
    for name in ("acceptance", "gain", "next_gain", "offered"):
        values = getattr(decision, name)
        if values is not None:
            attrs[f"spec.control.{name}"] = (*floats, *(float(v) for v in values))
    if decision.costs is not None:
        base, per_row, per_draft, per_verify = decision.costs
        attrs.update({"spec.control.cost.base_s": base, "spec.control.cost.per_row_s": per_row,
                      "spec.control.cost.per_draft_s": per_draft,
                      "spec.control.cost.per_verify_s": per_verify})
    for name in ("step_s", "floor", "rate"):
        value = getattr(decision, name)
        if value is not None and math.isfinite(value):  # floor is inf where no draft pays
            attrs[f"spec.control.{name}"] = float(value)
    return attrs
