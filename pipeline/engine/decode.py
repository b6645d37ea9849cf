"""A step's verify rows and their draft caps (within output cap, max_model_len, token budget)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from pipeline.engine.request import EngineRequest
from pipeline.protocol import StepPlan, draft_room


def steppable(req: EngineRequest, max_model_len: int) -> bool:
    # not when done by the engine's count (its finish notice is on its way) or still prefilling
    return (req.num_output > 0 and not req.prefilling and req.remaining > 0
            and req.seq_len <= max_model_len)


def draft_caps(running: Iterable[EngineRequest], k: int, max_model_len: int) -> dict[str, int]:
    return {r.rid: max(0, min(k, r.remaining - 1, draft_room(max_model_len, r.kv_len)))
            for r in running if steppable(r, max_model_len)}


def verify_budget(token_budget: int | None, running: Iterable[EngineRequest],
                  waiting: Iterable[EngineRequest], free_slots: int) -> int | None:
    """What waiting prompts leave, but at least half: drafts are optional, prefills are not."""
    if token_budget is None:
        return None
    demand = sum(r.prefill_len - r.computed for r in running if r.prefilling)
    demand += sum(len(r.prefill_ids) for r in itertools.islice(waiting, free_slots))
    if not demand:
        return token_budget
    return max(token_budget - demand, token_budget // 2)


def fit_caps(caps: dict[str, int], budget: int | None) -> None:
    """Shrink the largest cap by one until the rows (1 + cap each) fit or every cap is 0."""
    if budget is None:
        return
    total = sum(1 + c for c in caps.values())
    while total > budget:
        rid = max(caps, key=lambda r: caps[r], default=None)
        if rid is None or caps[rid] == 0:
            return
        caps[rid] -= 1
        total -= 1


def plan_verifies(plan: StepPlan, running: dict[str, EngineRequest],
                  caps: dict[str, int]) -> list[EngineRequest]:
    rows = [running[rid] for rid in caps]
    for req in rows:
        cap = caps[req.rid]
        plan.decode.append(req.rid)
        plan.last_tokens.append(req.last_token)
        plan.kv_lens.append(req.kv_len)
        plan.num_outputs.append(req.num_output)
        plan.ks.append(cap)
        req.reserved = req.kv_len + 1 + cap
    plan.caps = list(plan.ks)
    return rows
