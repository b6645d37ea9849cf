"""A lost draft stage costs nothing: steps go on without drafts until a replacement answers.

Drafts only decide how many tokens a verify step may accept, never which ones (lossless), so a
step whose proposal never came is verified with none (k = 0: plain target decoding, `drafted`
0 for every row, so `completion = 1 + verify_ct + accepted` holds as for any step). The engine
keeps running while a new draft stage starts in the background (the transport's job, e.g.
actors.draft_stage); once it answers, steps use it again.

A fresh draft stage knows no request. Every proposer's state per request is its sequence (the
registered prompt plus every commit since, pipeline.draft.base), built from the plans alone, so
the engine keeps a `DraftLedger` of what the draft stage was told and, before the first plan a
replacement sees, sends it one **catch-up plan**: every running request registered as it was
(its NewRequest, whole prompt prefilled) and its commits since, nothing to draft. After it the
replacement holds what the lost stage held (a draft model's KV cache is recomputed from the
tokens by its prefill and first propose), and the step's own plan follows as usual.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pipeline.protocol import NewRequest, StepOutcome, StepPlan

P = TypeVar("P")  # a proposal, or a transport's handle to one


@dataclasses.dataclass
class _Entry:
    new: NewRequest  # as the plan registered it
    tokens: list[int]  # every commit since, in order


class DraftLedger:
    """Per request the draft stage holds: its registration and every token committed since."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, plan: StepPlan) -> None:
        """What `plan` tells the draft stage, in the stage's order: release, register, commit."""
        for rid in plan.release:
            self._entries.pop(rid, None)
        for new in plan.new:
            self._entries[new.rid] = _Entry(new, [])
        for rid, tokens in plan.commits.items():
            entry = self._entries.get(rid)
            if entry is not None:
                entry.tokens.extend(tokens)

    def catch_up(self, step: int) -> StepPlan:
        """One plan that brings a draft stage that saw no plan to the state of one that saw
        every recorded plan: each request registered as it was, its whole registered prompt
        prefilled at once (chunk None), then its commits; no decode, so nothing is drafted."""
        return StepPlan(
            step=step,
            new=[dataclasses.replace(e.new, chunk=None) for e in self._entries.values()],
            commits={rid: list(e.tokens) for rid, e in self._entries.items() if e.tokens})


class DraftFailover:
    """Which plans the draft stage gets each step: all of them while it is live, none while it
    is lost, and a catch-up plan first once a replacement is up."""

    def __init__(self) -> None:
        self.ledger = DraftLedger()
        self.live = True
        self.losses = 0  # draft stages lost so far
        self.caught_up = 0  # requests registered with replacements by catch-up plans
        self._fresh = False  # the live stage is a replacement that has seen no plan yet

    def plans(self, plan: StepPlan) -> list[StepPlan]:
        """The plans to send the draft stage for `plan`'s step, in order ([] while it is lost:
        verify without a proposal); records `plan` in the ledger either way."""
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
        """The draft stage died: steps go on without drafts until `replaced`."""
        if self.live:
            self.losses += 1
        self.live = False

    def replaced(self) -> None:
        """A new draft stage answers: the next step catches it up, then drafts with it."""
        self.live = True
        self._fresh = True


async def step_with_draft(plan: StepPlan, failover: DraftFailover,
                          propose: Callable[[list[StepPlan]], P],
                          verify: Callable[[P | None], Awaitable[StepOutcome]],
                          draft_died: Callable[[P], Awaitable[bool]]) -> StepOutcome:
    """Draft and verify `plan`, surviving the draft stage's death.

    `propose(plans)` sends the plans to the draft stage in order and returns the last one's
    proposal (a handle the transport resolves: it may fail later); `verify(proposal)` runs the
    target ranks (None: no drafts) and must fail without running when its proposal failed;
    `draft_died(proposal)`, asked after a failed verify, says whether the draft stage died (then
    the step is verified again without drafts; any other failure is the caller's). The outcome's
    `undrafted` says the step had no draft stage (the spec controller learns nothing from it)."""
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
    """The failover's state for the engine's stats."""
    return {"draft_live": failover.live, "draft_losses": failover.losses,
            "draft_caught_up": failover.caught_up}
