"""Continuous batching: a bounded waiting queue (pipeline.engine.admission: fair across client
requests), a running set bounded by sequence slots and KV blocks, and the per-step plan (who is
prefilled, who is verified with how many drafts, whose slots are freed, who is preempted).

Invariants:
- a request holds one slot on every stage (target ranks, draft) from admission until the plan
  after its finish/abort (or its preemption) carries it in `release`; stages free before they
  allocate, so the slot budget is `num_slots - len(running)` when a plan is built;
- KV blocks (with `num_blocks`): the scheduler counts, per running request, the tokens its
  stages may hold after the step it planned (`reserved`: a prefill's tokens, or a verify's
  committed length + 1 + its draft cap), so the planned steps never need more than the pool.
  When the running requests' next steps do not fit, the newest (latest arrival) is preempted:
  its slots and blocks are released, and it goes back to the front of its group to be
  recomputed (prompt + output so far) as one prefill whose token is its next output token;
- the queue and the slots are counted in choices (engine requests); admission happens whenever
  slots are free, in the order pipeline.engine.admission's rules give (stated there once);
- chunked prefill (`token_budget`, a step's tokens): verify rows go first (1 + draft cap
  each; caps shrink, largest first, while they exceed the budget, or half of it while prompts
  wait: `_verify_budget`), then the prefills already under way continue in arrival order,
  then admissions take the rest. A prefill may span steps ([start, end) chunks in the plan),
  yields its first token only from its last chunk and verifies only after that. A prefilling
  request keeps the blocks of its whole prompt reserved from admission on, so it is never
  preempted mid-prefill;
- no verify writes past `max_model_len`, and none is scheduled once a request has as many
  output tokens as it may keep (`max_output`); the output processor decides the finish.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from pipeline.engine.admission import FairQueue
from pipeline.engine.spec.policy import SpecController
from pipeline.errors import EngineOverloadedError
from pipeline.params import SamplingParams
from pipeline.protocol import EngineCall, NewRequest, StepOutcome, StepPlan, draft_room
from pipeline.spec_settings import SpecSettings


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class EngineRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams  # as given to the output processor (max_new_tokens capped)
    status: Status = Status.WAITING
    num_output: int = 0  # tokens generated so far (the engine's view: may run past a finish)
    last_token: int = -1  # newest token; not yet in the target KV cache
    pending: list[int] = field(default_factory=list)  # last step's tokens, not yet committed
    group: str = ""  # the client request it belongs to (fair admission); "" = its own rid
    tenant: str = ""  # hash of its API key and `user` (pipeline.frontend.tenant); "" anonymous
    seq: int = 0  # arrival order, set when queued
    output_ids: list[int] = field(default_factory=list)  # every token generated so far
    reserved: int = 0  # KV tokens its stages may hold after the step last planned for it
    prefill_len: int = 0  # tokens its current admission prefills (prompt + output so far)
    computed: int = 0  # of those, how many the stages' KV holds after the steps planned so far

    def __post_init__(self) -> None:
        self.group = self.group or self.rid

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return self.num_prompt + self.num_output

    @property
    def prefill_ids(self) -> list[int]:
        """What its (re)admission prefills: the prompt, plus the output after a preemption."""
        return self.prompt_ids + self.output_ids

    @property
    def prefilling(self) -> bool:
        """Admitted, and its prefill's last chunk not yet planned."""
        return self.computed < self.prefill_len

    @property
    def kv_len(self) -> int:
        return self.seq_len - 1

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - self.num_output


class Scheduler:
    def __init__(self, num_slots: int, max_waiting: int, max_model_len: int,
                 num_speculative_tokens: int,
                 vocab_size: int, reserved_slots: int = 0,
                 spec: SpecController | None = None, reserved_waiting: int = 0,
                 num_blocks: int | None = None, block_size: int = 16,
                 token_budget: int | None = None) -> None:
        # Sequence slots of every stage, the most requests running: the config's `num_seqs`
        # (max_num_seqs, else its num_slots), which is also how many slots each stage has.
        self.num_slots = num_slots
        # The most tokens one step computes (chunked prefill; the config's
        # max_num_batched_tokens); None: no budget.
        self.token_budget = token_budget
        # The KV pool of every stage (None: no block accounting, slots are the only limit).
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.preemptions = 0
        self.max_waiting = max_waiting
        # the last places a group's second and later choices may not take (_check_room)
        self.reserved_waiting = min(reserved_waiting, max_waiting)
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        # Chooses each decode's k under its cap (fixed: the cap itself).
        self.spec = spec or SpecController(SpecSettings("fixed", num_speculative_tokens))
        self.vocab_size = vocab_size
        # At most num_slots - 1 reserved: a lone request can always run.
        self.waiting = FairQueue(min(reserved_slots, num_slots - 1))
        self.running: dict[str, EngineRequest] = {}
        self._held: Counter[str] = Counter()  # running slots per group
        self._release: list[str] = []
        self._finals: dict[str, list[int]] = {}  # released requests' uncommitted tokens
        self._step = 0
        self._new: list[EngineRequest] = []  # the last plan's new requests (their cache hits)
        # A batch job's last request is queued: once nothing waits, the batch drains (no
        # request will take a freed slot). Cleared by a request arriving at an idle engine.
        self._closed = False

    # --- requests in and out --------------------------------------------------------------
    def prepare(self, call: EngineCall) -> EngineRequest:
        """Validate a request and cap its output at max_model_len; queues nothing (`enqueue`
        takes the call's `last`). Raises ValueError (bad prompt, id in use) or
        EngineOverloadedError (queue full)."""
        rid, prompt_ids, params = call.rid, call.prompt_ids, call.params
        if rid in self.running or rid in self.waiting:
            raise ValueError(f"request id {rid!r} is already in use")
        self.check_prompt(prompt_ids)
        group = call.group or rid
        self._check_room(group)
        # The engine never writes past max_model_len, so the output may not either.
        cap = min(params.max_new_tokens, self.max_model_len - len(prompt_ids))
        params = dataclasses.replace(params, max_new_tokens=cap,
                                     min_new_tokens=min(params.min_new_tokens, cap))
        return EngineRequest(rid, list(prompt_ids), params, group=group, tenant=call.tenant)

    def enqueue(self, req: EngineRequest, last: bool = False) -> EngineRequest:
        """`last`: the client sends no request after this one (a batch job's final prompt), so
        the batch drains once it is admitted. Requests of the same batch may still arrive out of
        order after it; one arriving at an idle engine starts a new batch."""
        self._check_room(req.group)
        if not self.has_work:
            self._closed = False
        self.waiting.push(req)
        self._closed = self._closed or last
        return req

    def _check_room(self, group: str) -> None:
        """A place for one more choice of `group`: any free place for a group's first waiting
        choice, only the first max_waiting - reserved_waiting for its later ones. So no client
        request holds more than that share, and however many fan-outs arrive, the reserve stays
        for single requests (and first choices, which a refused fan-out gives back at once)."""
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
        """A finish notice or an abort: a waiting request is dropped, a running one's slots are
        released with the next plan. Returns the request if it was still known."""
        req = self.waiting.remove(rid)
        if req is not None:
            req.status = Status.FINISHED
            return req
        req = self.running.pop(rid, None)
        if req is not None:
            req.status = Status.FINISHED
            self._release.append(rid)
            if req.pending:
                self._finals[rid] = req.pending
            self.spec.forget(rid)
            self._held[req.group] -= 1
            if self._held[req.group] <= 0:
                del self._held[req.group]
        return req

    def releasing(self, rid: str) -> bool:
        """Finished, and its slots wait for the next plan's release."""
        return rid in self._release

    # --- one step -------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step's plan (release, preempt if the KV pool is short, admit fairly into
        free slots and blocks, verify the rest); a release-only plan when only slots are left
        to free; None when there is nothing to do."""
        decode = [r for r in self.running.values() if self._steppable(r)]
        # No drafts past the output cap or past the slot's max_len.
        caps = {r.rid: max(0, min(self.num_speculative_tokens, r.remaining - 1,
                                  draft_room(self.max_model_len, r.kv_len)))
                for r in decode}
        _fit(caps, self._verify_budget(decode))
        preempted = self._preempt(decode, caps)
        decode = [r for r in decode if r.rid in self.running]
        left = None if self.token_budget is None else max(
            0, self.token_budget - sum(1 + c for c in caps.values()))
        chunks = []  # prefills under way, oldest first: (request, start, end)
        for req in sorted((r for r in self.running.values() if r.prefilling),
                          key=lambda r: r.seq):
            n = req.prefill_len - req.computed if left is None else min(
                left, req.prefill_len - req.computed)
            if n <= 0:
                break
            chunks.append((req, req.computed, req.computed + n))
            left = None if left is None else left - n
        admitted = [] if preempted or left == 0 else self.waiting.admit(
            self.num_slots - len(self.running), self._held, self._free_blocks(decode, caps),
            self._admission_blocks, left, lambda r: len(r.prefill_ids))
        if not decode and not admitted and not chunks and not self._release:
            return None
        plan = StepPlan(step=self._step, release=self._release, finals=self._finals)
        self._step += 1
        self._release, self._finals = [], {}
        for req in self.running.values():
            if req.pending:
                plan.commits[req.rid] = req.pending
                req.pending = []
        for req in decode:
            plan.decode.append(req.rid)
            plan.last_tokens.append(req.last_token)
            plan.kv_lens.append(req.kv_len)
            plan.num_outputs.append(req.num_output)
            plan.ks.append(caps[req.rid])
            req.reserved = req.kv_len + 1 + caps[req.rid]
        plan.caps = list(plan.ks)
        # a drain: nothing waits or will come, every running request is past its prefill
        drain = (self._closed and not self.waiting and not admitted
                 and all(r.num_output > 0 and not r.prefilling for r in self.running.values()))
        # No k is pinned: a seeded request's output does not depend on its drafts (its
        # randomness is keyed by output position, pipeline.verify.acceptance).
        plan.ks = self.spec.choose(plan.decode, plan.ks, None,
                                   [r.remaining for r in decode] if drain else None)
        plan.min_gains = self.spec.min_gains(plan.decode)
        for req, start, end in chunks:
            plan.prefills.append(req.rid)
            plan.prefill_starts.append(start)
            plan.prefill_ends.append(end)
            req.computed = end
        for req in admitted:
            req.status = Status.RUNNING
            self.running[req.rid] = req
            ids = req.prefill_ids
            req.reserved = req.prefill_len = len(ids)
            # its first chunk; the stages start it past their cache hit (added in `apply`)
            req.computed = len(ids) if left is None else min(left, len(ids))
            chunk = None if req.computed == len(ids) else req.computed
            left = None if left is None else left - req.computed
            plan.new.append(NewRequest(req.rid, ids, req.params, req.tenant,
                                       num_output=req.num_output, chunk=chunk))
        self._new = admitted
        return plan

    def _verify_budget(self, decode: list[EngineRequest]) -> int | None:
        """The step tokens verify rows may take: all of the budget when no prompt waits to be
        prefilled, else what the prompts leave but at least half (drafts are optional work, a
        prefill is not: without a share, many streams at full k would hold every new request
        back until some finished). A row's own token always goes (at least one each)."""
        if self.token_budget is None:
            return None
        free = self.num_slots - len(self.running)
        demand = sum(r.prefill_len - r.computed for r in self.running.values() if r.prefilling)
        demand += sum(len(r.prefill_ids) for r in itertools.islice(self.waiting, free))
        if not demand:
            return self.token_budget
        return max(self.token_budget - demand, self.token_budget // 2)

    # --- KV blocks ------------------------------------------------------------------------
    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _need(self, decode: list[EngineRequest], caps: dict[str, int]) -> int:
        """Blocks the running requests hold after this step's forward (verifies grow to their
        committed length + 1 + cap; the rest keep what they reserved)."""
        return sum(self._blocks(r.kv_len + 1 + caps[r.rid] if r.rid in caps else r.reserved)
                   for r in self.running.values())

    def _free_blocks(self, decode: list[EngineRequest], caps: dict[str, int]) -> int | None:
        if self.num_blocks is None:
            return None
        return self.num_blocks - self._need(decode, caps)

    def _admission_blocks(self, req: EngineRequest) -> int:
        """A newcomer's prefill plus its first verify (so it is not preempted at once); never
        more than one max_model_len request, which the pool always holds."""
        return self._blocks(min(len(req.prompt_ids) + len(req.output_ids) + 1
                                + self.num_speculative_tokens,
                                self.max_model_len))

    def _preempt(self, decode: list[EngineRequest], caps: dict[str, int]) -> list[str]:
        """Preempt the newest verifying requests until every running request's next step fits
        the pool. A lone request always fits (kv_cache_tokens >= max_model_len), and the
        non-verifying ones fit in what they held last step."""
        if self.num_blocks is None:
            return []
        out: list[str] = []
        victims = sorted(decode, key=lambda r: r.seq)
        while victims and self._need(decode, caps) > self.num_blocks:
            req = victims.pop()
            del caps[req.rid]
            decode.remove(req)
            self._requeue(req)
            out.append(req.rid)
        return out

    def _requeue(self, req: EngineRequest) -> None:
        """Free its slots (next plan's release) and put it back at the front of its group; its
        pending tokens are part of `output_ids`, so they come back with its recompute."""
        del self.running[req.rid]
        self._release.append(req.rid)
        self.spec.forget(req.rid)
        self._held[req.group] -= 1
        if self._held[req.group] <= 0:
            del self._held[req.group]
        req.pending = []
        req.reserved = req.prefill_len = req.computed = 0
        req.status = Status.WAITING
        self.waiting.push_front(req)
        self.preemptions += 1

    def _steppable(self, req: EngineRequest) -> bool:
        # Done by the engine's count (its finish notice is on its way) or not prefilled yet.
        return (req.num_output > 0 and not req.prefilling and req.remaining > 0
                and req.seq_len <= self.max_model_len)

    def apply(self, outcome: StepOutcome) -> None:
        """Record what a step produced (requests finished meanwhile are skipped): the new
        requests' cache hits move their prefill on (the stages computed their first chunk past
        the hit), and a request that got tokens has finished its prefill."""
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

    # --- views ----------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.num_slots - len(self.running)

    @property
    def blocks_used(self) -> int:
        """KV blocks the running requests' planned steps hold (of `num_blocks`)."""
        return sum(self._blocks(r.reserved) for r in self.running.values())

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._release)


def _fit(caps: dict[str, int], budget: int | None) -> None:
    """Shrink the draft caps (largest first, one at a time) until the verify rows, 1 + cap
    each, fit the step's token budget or every cap is 0."""
    if budget is None:
        return
    total = sum(1 + c for c in caps.values())
    while total > budget:
        rid = max(caps, key=lambda r: caps[r], default=None)
        if rid is None or caps[rid] == 0:
            return
        caps[rid] -= 1
        total -= 1
