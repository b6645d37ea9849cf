"""A lost draft stage costs nothing: steps verify without drafts until a replacement answers,
which a catch-up plan first brings to the lost stage's state (docs/reliability.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pipeline.protocol import NewRequest, StepOutcome, StepPlan

P = TypeVar("P")  # a proposal, or a transport's handle to one


@dataclasses.dataclass
class _Entry:
    new: NewRequest
    tokens: list[int]


class DraftLedger:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, plan: StepPlan) -> None:
        # in the draft stage's order: release, register, commit
        for rid in plan.release:
            self._entries.pop(rid, None)
        for new in plan.new:
            self._entries[new.rid] = _Entry(new, [])
        for rid, tokens in plan.commits.items():
            entry = self._entries.get(rid)
            if entry is not None:
                entry.tokens.extend(tokens)

    def catch_up(self, step: int) -> StepPlan:
        return StepPlan(
            step=step,
            new=[dataclasses.replace(e.new, chunk=None) for e in self._entries.values()],
            commits={rid: list(e.tokens) for rid, e in self._entries.items() if e.tokens})


class DraftFailover:
    def __init__(self) -> None:
        self.ledger = DraftLedger()
        self.live = True
        self.losses = 0
        self.caught_up = 0
        self._fresh = False  # a replacement that has seen no plan yet

    def plans(self, plan: StepPlan) -> list[StepPlan]:
        out: list[StepPlan] = []
        if self.live and self._fresh:
            up = self.ledger.catch_up(plan.step)
            self.caught_up += len(up.new)
            out = [up, plan]
        elif self.live:
            out = [plan]
        self._fresh = False
        self.ledger.record(plan)
        return out

    def lost(self) -> None:
        if self.live:
            self.losses += 1
        self.live = False

    def replaced(self) -> None:
        self.live = True
        self._fresh = True


async def step_with_draft(plan: StepPlan, failover: DraftFailover,
                          propose: Callable[[list[StepPlan]], P],
                          verify: Callable[[P | None], Awaitable[StepOutcome]],
                          draft_died: Callable[[P], Awaitable[bool]]) -> StepOutcome:
    """`verify` must fail without running when its proposal failed; `draft_died` then says
    whether to verify again without drafts (any other failure is the caller's)."""
    plans = failover.plans(plan)
    proposal = propose(plans) if plans else None
    try:
        outcome = await verify(proposal)
    except Exception:
        if proposal is None or not await draft_died(proposal):
            raise
        failover.lost()
        proposal = None
        outcome = await verify(None)
    outcome.undrafted = proposal is None
    return outcome


def describe(failover: DraftFailover) -> dict[str, Any]:
    return {"draft_live": failover.live, "draft_losses": failover.losses,
            "draft_caught_up": failover.caught_up}
