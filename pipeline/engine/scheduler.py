"""Continuous batching: a bounded waiting queue (fair across client requests,
pipeline.engine.admission), a running set bounded by sequence slots and KV blocks, and each
step's plan. A request holds one slot on every stage from admission until a plan carries it in
`release` (stages free before they allocate). A step plans, in order: verify rows (`decode`),
preemption when their blocks do not fit (the newest goes back to the front of its group and
later recomputes prompt + output as one prefill), continuing prefill chunks and admissions
(`prefill`); no verify writes past max_model_len or past the request's output cap."""

from __future__ import annotations

import dataclasses
from collections import Counter

from pipeline.engine.admission import FairQueue
from pipeline.engine.blocks import BlockBudget
from pipeline.engine.decode import draft_caps, fit_caps, plan_verifies, verify_budget
from pipeline.engine.prefill import TokenBudget, continuing_chunks, plan_chunks
from pipeline.engine.request import EngineRequest, Status
from pipeline.engine.spec.policy import SpecController
from pipeline.errors import EngineOverloadedError
from pipeline.protocol import EngineCall, NewRequest, StepOutcome, StepPlan
from pipeline.spec_settings import SpecSettings

__all__ = ["EngineRequest", "Scheduler", "Status"]


class Scheduler:
    def __init__(self, max_running: int, max_waiting: int, max_model_len: int,
                 num_speculative_tokens: int,
                 vocab_size: int, reserved_slots: int = 0,
                 spec: SpecController | None = None, reserved_waiting: int = 0,
                 num_blocks: int | None = None, block_size: int = 16,
                 token_budget: int | None = None) -> None:
        self.max_running = max_running
        self.token_budget = token_budget  # max_num_batched_tokens
        self.blocks = BlockBudget(num_blocks, block_size, max_model_len, num_speculative_tokens)
        self.preemptions = 0
        self.max_waiting = max_waiting
        self.reserved_waiting = min(reserved_waiting, max_waiting)
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.spec = spec or SpecController(SpecSettings("fixed", num_speculative_tokens))
        self.vocab_size = vocab_size
        self.waiting = FairQueue(min(reserved_slots, max_running - 1))
        self.running: dict[str, EngineRequest] = {}
        self._held: Counter[str] = Counter()  # running requests per group
        self._release: list[str] = []
        self._finals: dict[str, list[int]] = {}  # released requests' uncommitted tokens
        self._step = 0
        self._new: list[EngineRequest] = []
        self._closed = False  # a batch job's last request is queued: once nothing waits, it drains

    def prepare(self, call: EngineCall) -> EngineRequest:
        """Validate (ValueError, EngineOverloadedError) and cap the output at max_model_len."""
        rid, prompt_ids, params = call.rid, call.prompt_ids, call.params
        if rid in self.running or rid in self.waiting:
            raise ValueError(f"request id {rid!r} is already in use")
        self.check_prompt(prompt_ids)
        group = call.group or rid
        self._check_room(group)
        cap = min(params.max_new_tokens, self.max_model_len - len(prompt_ids))
        params = dataclasses.replace(params, max_new_tokens=cap,
                                     min_new_tokens=min(params.min_new_tokens, cap))
        return EngineRequest(rid, list(prompt_ids), params, group=group, tenant=call.tenant)

    def enqueue(self, req: EngineRequest, last: bool = False) -> EngineRequest:
        self._check_room(req.group)
        if not self.has_work:
            self._closed = False
        self.waiting.push(req)
        self._closed = self._closed or last
        return req

    def _check_room(self, group: str) -> None:
        # the last reserved_waiting places are kept for single requests and first choices
        waiting = len(self.waiting)
        if waiting >= self.max_waiting:
            raise EngineOverloadedError(
                f"waiting queue is full ({self.max_waiting} queued choices); retry later")
        if self.waiting.count(group) and waiting >= self.max_waiting - self.reserved_waiting:
            raise EngineOverloadedError(
                f"waiting queue: the last {self.reserved_waiting} of {self.max_waiting} places "
                f"are kept for single requests; retry later")

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids: the prompt must have at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt_ids: {len(prompt_ids)} prompt tokens leave no room under "
                             f"max_model_len {self.max_model_len}")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: token {bad[0]!r} is outside [0, {self.vocab_size})")

    def finish(self, rid: str) -> EngineRequest | None:
        """A finish or abort; a running request's slots go with the next plan's release."""
        req = self.waiting.remove(rid)
        if req is not None:
            req.status = Status.FINISHED
            return req
        req = self.running.get(rid)
        if req is not None:
            self._stop(req)
            req.status = Status.FINISHED
            if req.pending:
                self._finals[rid] = req.pending
        return req

    def releasing(self, rid: str) -> bool:
        return rid in self._release

    def _stop(self, req: EngineRequest) -> None:
        del self.running[req.rid]
        self._release.append(req.rid)
        self.spec.forget(req.rid)
        self._held[req.group] -= 1
        if self._held[req.group] <= 0:
            del self._held[req.group]

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to do (nor to release)."""
        caps = draft_caps(self.running.values(), self.num_speculative_tokens,
                          self.max_model_len)
        fit_caps(caps, verify_budget(self.token_budget, self.running.values(), self.waiting,
                                     self.free_slots))
        preempted = self._preempt(caps)
        budget = TokenBudget.after_verifies(self.token_budget, caps.values())
        chunks = continuing_chunks(self.running.values(), budget)
        admitted = [] if preempted or budget.spent else self._admit(caps, budget)
        if not caps and not admitted and not chunks and not self._release:
            return None
        plan = self._start_plan()
        rows = plan_verifies(plan, self.running, caps)
        self._choose_ks(plan, rows, drain=self._draining(admitted))
        plan_chunks(plan, chunks)
        for req in admitted:
            plan.new.append(self._start(req, budget))
        self._new = admitted
        return plan

    def plan_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The step after `plan` (decodes without drafts: one token a row), planned before its
        outcome: each row one token further, its input the verifier's own last sample (-1).
        None where the next plan needs the outcome (admissions, chunks, releases, grammars)."""
        if plan.new or plan.prefills or any(plan.ks) or self._release or self._new:
            return None
        if (self.waiting and self.free_slots) or any(r.prefilling for r in self.running.values()):
            return None
        rows = [self.running[rid] for rid in plan.decode if rid in self.running]
        rows = [r for r in rows if r.remaining > 1 and r.seq_len < self.max_model_len]
        if not rows or any(r.params.grammar is not None for r in rows):
            return None
        free = self.blocks.free(self.running.values(), {r.rid: 1 for r in rows})
        if free is not None and free < 0:
            return None
        ahead_plan = StepPlan(step=self._step)
        self._step += 1
        for req in rows:
            ahead_plan.decode.append(req.rid)
            ahead_plan.last_tokens.append(-1)
            ahead_plan.kv_lens.append(req.kv_len + 1)
            ahead_plan.num_outputs.append(req.num_output + 1)
            ahead_plan.ks.append(0)
            req.reserved = req.kv_len + 2
        ahead_plan.caps = list(ahead_plan.ks)
        return ahead_plan

    def _preempt(self, caps: dict[str, int]) -> bool:
        victims = self.blocks.victims(self.running, caps)
        for req in victims:
            del caps[req.rid]
            self._requeue(req)
        return bool(victims)

    def _requeue(self, req: EngineRequest) -> None:
        # its pending tokens are in `output_ids`: they come back with its recompute
        self._stop(req)
        req.pending = []
        req.reserved = req.prefill_len = req.computed = 0
        req.status = Status.WAITING
        self.waiting.push_front(req)
        self.preemptions += 1

    def _admit(self, caps: dict[str, int], budget: TokenBudget) -> list[EngineRequest]:
        return self.waiting.admit(self.free_slots, self._held,
                                  self.blocks.free(self.running.values(), caps),
                                  self.blocks.admission, budget.left,
                                  lambda r: len(r.prefill_ids))

    def _start_plan(self) -> StepPlan:
        plan = StepPlan(step=self._step, release=self._release, finals=self._finals)
        self._step += 1
        self._release, self._finals = [], {}
        for req in self.running.values():
            if req.pending:
                plan.commits[req.rid] = req.pending
                req.pending = []
        return plan

    def _draining(self, admitted: list[EngineRequest]) -> bool:
        return (self._closed and not self.waiting and not admitted
                and all(r.num_output > 0 and not r.prefilling for r in self.running.values()))

    def _choose_ks(self, plan: StepPlan, rows: list[EngineRequest], drain: bool) -> None:
        # none pinned: a seeded request's randomness is keyed by output position, not drafts
        plan.ks = self.spec.choose(plan.decode, plan.ks, None,
                                   [r.remaining for r in rows] if drain else None)
        plan.min_gains = self.spec.min_gains(plan.decode)

    def _start(self, req: EngineRequest, budget: TokenBudget) -> NewRequest:
        # its stages start the first chunk past their cache hit (added in `apply`)
        req.status = Status.RUNNING
        self.running[req.rid] = req
        ids = req.prefill_ids
        req.reserved = req.prefill_len = len(ids)
        req.computed = budget.take(len(ids))
        chunk = None if req.computed == len(ids) else req.computed
        return NewRequest(req.rid, ids, req.params, req.tenant, num_output=req.num_output,
                          chunk=chunk)

    def apply(self, outcome: StepOutcome) -> None:
        """Record a step's outcome; a request that got tokens has finished its prefill."""
        for req, cached in zip(self._new, outcome.cached):
            req.computed = min(req.prefill_len, req.computed + cached)
        self._new = []
        for rid, tokens in zip(outcome.rids, outcome.tokens):
            req = self.running.get(rid)
            if req is None:
                continue
            req.computed = req.prefill_len
            req.num_output += len(tokens)
            req.last_token = tokens[-1]
            req.pending.extend(tokens)
            req.output_ids.extend(tokens)

    @property
    def num_blocks(self) -> int | None:
        return self.blocks.num_blocks

    @property
    def free_slots(self) -> int:
        return self.max_running - len(self.running)

    @property
    def blocks_used(self) -> int:
        return self.blocks.used(self.running.values())

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._release)
