"""Why a step's k was chosen: the controller's decision for one step, as a record and as span
attributes (`spec.control.*` on the engine's `spec.engine_step` span; the names are documented
with the other trace names in pipeline/tracing/schema.py).

The controller keeps what it computed anyway while planning (`SpecController.decision`), and this
record is built from it only for a step whose span is sampled, so an unsampled step pays nothing
and a sampled one a few passes over its batch: nothing per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PLANS = ("rate", "drain", "fixed", "off")  # off: no step measured at this batch size yet
WHY = ("plan", "probe", "explore", "pinned")  # what set a request's k ("prefill" in spans)


@dataclass
class Decision:
    """One step's choice for its decode requests (lists aligned with `rids`).

    `acceptance` is the estimated acceptance of the request's next draft (position 0), `gain`
    the expected extra tokens of the k drafts asked for, if the proposer has them (S_1 + ... +
    S_k), `next_gain` the expected gain of one more draft (S_{k+1}; 0 at the cap), `offered` how
    often the request's proposer had a draft when asked. A planned draft pays where its gain beats
    `floor` (tokens a verify row must bring at the plan's rate); the plan also weighs the longest
    draft's cost, so `next_gain < floor <= S_k` holds for most requests, not all. The estimates
    are None where the plan used none (fixed, off). `costs`: the step-cost model's (base of a
    plain step of this batch, per verify row, per draft position, fixed cost of verifying any
    draft), seconds, before the margin; `step_s` the step's predicted seconds if every asked
    draft comes; `rate` the plan's expected tokens per second (margin-priced)."""

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
    """`spec.request.ids` (the step's requests in message order: `prefills`, then the decodes)
    and the `spec.control.*` attributes aligned with it; a prefill gets k = cap = 0, why
    "prefill" and 0.0 for the estimates. `decision` None: a step of prefills only."""
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
