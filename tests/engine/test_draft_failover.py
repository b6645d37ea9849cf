"""A lost draft stage costs nothing (pipeline.engine.draft_failover), in process: the draft dies
mid-step, steps go on without drafts, a fresh proposer takes over after a catch-up plan.

Evidence that cannot pass vacuously: greedy outputs equal target-only, every request's
statistics keep `completion = 1 + verify_ct + accepted`, the replacement drafts again for
requests that started before the loss, and its drafts equal those of a shadow proposer that
saw every plan (so the catch-up rebuilt exactly the lost stage's state)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any, ClassVar

import pytest
from support.engine_cases import PROMPTS, expected_cut, mixed_requests
from support.reference_decode import target_references

from pipeline.config import load_config
from pipeline.draft.step import build_proposer, draft_step
from pipeline.engine.draft_failover import DraftFailover, DraftLedger, step_with_draft
from pipeline.engine.local import LocalStages, build_local_engine, collect
from pipeline.grammar.tracker import GrammarTracker
from pipeline.params import SamplingParams
from pipeline.protocol import NewRequest, Proposal, StepOutcome, StepPlan

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"
KILL_AT = 6  # the step whose proposal never comes
DOWN = 5  # steps verified without a draft stage before the replacement answers


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    refs = target_references(CONFIG, PROMPTS, 60)
    return dict(enumerate(refs))


class DraftDied(Exception):
    """What the proposal of a draft stage that died mid-step resolves to."""


class LosingDraftStages(LocalStages):
    """LocalStages whose draft stage dies at step KILL_AT and is replaced by a fresh proposer
    DOWN steps later, through the failover the Ray engine uses. A shadow proposer sees every
    plan, as a draft stage that never died would."""

    config: ClassVar[Any] = None

    def __init__(self, proposer: Any, verifier: Any, output: Any) -> None:
        super().__init__(proposer, verifier, output)
        self.failover = DraftFailover()
        self.shadow = build_proposer(self.config)
        self.shadow_grammars = GrammarTracker(lambda: verifier.runner.tokenizer)
        self.replaced_at: int | None = None
        self.steps: list[tuple[int, list[str], list[int], bool]] = []  # step, rids, drafted, lost
        self.compared = 0  # replacement proposals checked against the shadow's

    async def run_step(self, plan: StepPlan) -> StepOutcome:
        if not self.failover.live and plan.step >= KILL_AT + DOWN:
            self.proposer = build_proposer(self.config)  # the replacement, empty
            self.grammars = GrammarTracker(lambda: self.verifier.runner.tokenizer)
            self.failover.replaced()
            self.replaced_at = plan.step
        shadow = draft_step(self.shadow, plan, self.shadow_grammars)
        outcome = await step_with_draft(plan, self.failover,
                                        functools.partial(self._propose, shadow),
                                        functools.partial(self._verify, plan), self._died)
        if outcome.rids:
            self.steps.append((plan.step, outcome.rids, outcome.drafted, outcome.undrafted))
        return outcome

    def _propose(self, shadow: Proposal, plans: list[StepPlan]) -> Proposal | DraftDied:
        if plans[-1].step == KILL_AT:
            return DraftDied()
        proposal = None
        for p in plans:
            proposal = draft_step(self.proposer, p, self.grammars)
        if self.replaced_at is not None:
            assert proposal.tokens == shadow.tokens, (plans[-1].step, proposal, shadow)
            self.compared += sum(map(len, proposal.tokens))
        return proposal

    async def _verify(self, plan: StepPlan, proposal: Proposal | DraftDied | None) -> StepOutcome:
        if isinstance(proposal, DraftDied):  # as under Ray: the ranks never run the step
            raise RuntimeError("the proposal failed")  # noqa: TRY004 - what Ray raises
        return await asyncio.to_thread(self.verifier.step, plan, proposal)

    async def _died(self, proposal: Any) -> bool:
        return isinstance(proposal, DraftDied)


@pytest.mark.parametrize(("draft", "overrides"), [
    ("model", {"speculation": "fixed"}),
    ("ngram", {"speculation": "fixed"}),
    ("suffix", {"speculation": "adaptive", "num_speculative_tokens": 8}),
])
def test_a_draft_lost_mid_step_costs_nothing_and_its_replacement_catches_up(
        reference, draft, overrides):
    config = load_config(CONFIG, {"draft": draft, **overrides})
    LosingDraftStages.config = config
    core = build_local_engine(config, stages_type=LosingDraftStages)
    stages: LosingDraftStages = core.stages
    # the first four long enough to run through the loss and past the replacement
    requests = [(rid, p, dataclasses.replace(params, max_new_tokens=60 if i < 4 else 30))
                for i, (rid, p, params) in enumerate(mixed_requests(8))]

    async def main() -> tuple[dict, dict, dict]:
        out = await collect(core, requests)
        return out, core.health(), await core.stats_dict()

    out, health, stats = asyncio.run(main())

    for rid, prompt, params in requests:
        want_ids, want_text = expected_cut(reference[PROMPTS.index(prompt)], params)
        done = out[rid]
        assert (done.token_ids, done.text) == (want_ids, want_text), rid
        last = done.last
        assert last.finished and last.finish_reason != "error"
        assert len(done.token_ids) == 1 + last.spec_verify_ct + last.spec_accepted_tokens, rid
    assert health["healthy"] and core.dead_reason is None

    lost = [s for s in stages.steps if s[3]]
    assert lost and lost[0][0] == KILL_AT and all(sum(d) == 0 for *_, d, _ in lost)
    assert stages.failover.losses == 1 and stages.failover.live
    # drafts resume, also for requests that were running before the loss (the catch-up)
    before = {r for step, rids, _, _ in stages.steps if step < KILL_AT for r in rids}
    after = [(r, d) for step, rids, drafted, _ in stages.steps if step >= stages.replaced_at
             for r, d in zip(rids, drafted)]
    assert any(d > 0 and r in before for r, d in after), after
    assert stages.compared > 0
    assert stats["num_draft_tokens"] == sum(sum(d) for *_, d, _ in stages.steps)


def _plan(step: int, **kw: Any) -> StepPlan:
    return StepPlan(step=step, **kw)


def test_the_ledger_replays_registrations_and_commits_and_forgets_released_requests():
    params = SamplingParams(max_new_tokens=8)
    ledger = DraftLedger()
    ledger.record(_plan(0, new=[NewRequest("a", [1, 2, 3], params, "t", chunk=2),
                                NewRequest("b", [4, 5], params, num_output=1)]))
    ledger.record(_plan(1, commits={"a": [7], "b": [8, 9]}))
    ledger.record(_plan(2, release=["b"], commits={"a": [10]}, finals={"b": [11]}))
    ledger.record(_plan(3, new=[NewRequest("c", [6], params)]))
    up = ledger.catch_up(4)
    assert up.step == 4 and not up.decode and not up.release and not up.prefills
    assert [(n.rid, n.prompt_ids, n.tenant, n.chunk) for n in up.new] == [
        ("a", [1, 2, 3], "t", None), ("c", [6], "", None)]
    assert up.commits == {"a": [7, 10]}
    assert len(ledger) == 2


def test_failover_sends_nothing_while_lost_then_a_catch_up_plan_once():
    failover = DraftFailover()
    params = SamplingParams(max_new_tokens=8)
    p0 = _plan(0, new=[NewRequest("a", [1, 2], params)])
    assert failover.plans(p0) == [p0]
    failover.lost()
    failover.lost()  # one loss, however often it is noticed
    p1 = _plan(1, commits={"a": [3]})
    assert failover.plans(p1) == [] and failover.losses == 1
    failover.replaced()
    p2 = _plan(2, commits={"a": [4]})
    up, same = failover.plans(p2)
    assert same is p2 and up.commits == {"a": [3]} and [n.rid for n in up.new] == ["a"]
    assert failover.caught_up == 1
    p3 = _plan(3)
    assert failover.plans(p3) == [p3]


def test_step_with_draft_verifies_again_without_drafts_only_when_the_draft_died():
    plan = _plan(0)
    calls: list[Any] = []

    async def verify(proposal: Any) -> StepOutcome:
        calls.append(proposal)
        if proposal == "dead":
            raise RuntimeError("dependency failed")
        if proposal == "bad":
            raise ValueError("a verifier failed")
        return StepOutcome(0, [], [], [])

    async def died(proposal: Any) -> bool:
        return proposal == "dead"

    failover = DraftFailover()
    outcome = asyncio.run(step_with_draft(plan, failover, lambda _: "dead", verify, died))
    assert calls == ["dead", None] and outcome.undrafted and not failover.live
    failover = DraftFailover()
    with pytest.raises(ValueError):
        asyncio.run(step_with_draft(plan, failover, lambda _: "bad", verify, died))
    assert failover.live
    outcome = asyncio.run(step_with_draft(plan, failover, lambda _: "ok", verify, died))
    assert not outcome.undrafted
