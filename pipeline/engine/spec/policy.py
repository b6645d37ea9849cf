"""The adaptive controller: how many drafts each request verifies this step (k, 0 allowed).

Each step the engine asks `choose` for a k per request, under the request's cap (room left under
its length limits), and reports the step's outcome to `observe`. In between, `decision` says why
(`pipeline.engine.spec.record`, put on the step's span when it is sampled).

What it learns (`pipeline.engine.spec.estimate`): per request and draft position, the chance a
draft is accepted, starting from the pooled estimate of recent requests (an engine-wide EMA
over every request's outcomes) and moving to the request's own as it accumulates. In the pool, a
position nobody has drafted yet is taken to be no worse than the one before it, so after copied
text a new request drafts long from its first step. The pools' evidence fades each step that
verifies a draft, so a position nobody has drafted lately falls back to that carried prior; a
step with no draft verified says nothing about any position and leaves the pools as they are
(else a long stretch of plain decoding between two copies would erase what the first taught).
Each request keeps two estimates, by the outcome of its last verified draft: accepted whole
(inside a run: copied text goes on) or not (at a run's edge, or never in one). Acceptance on
copy-like text is bimodal, and one average would draft too little inside runs and too much
between them. A probe kept whole counts for the first estimate but does not start a run.

How it plans (`pipeline.engine.spec.plan`, priced by `pipeline.engine.spec.cost`): the rate
plan (most expected retained tokens per second for the whole batch) under sustained load, with
every draft's cost counted up to `margin` times at batch > 1, since a verify row slows every
other request of the batch (the factor grows with their share, 1 + (margin - 1) (b - 1) / b;
at batch 1 the request's own rate is the whole objective). Every request's tokens count alike: a
request that finishes sooner hands its slot to the next one, and a server cannot tell a drain
from a lull between arrivals. A batch job can: it marks its last request, and once that one is
admitted and nothing waits, the batch drains and only its end matters (the drain plan).

Overrides of the plan, each for a reason:
- pinned: a seeded sampled request always gets its cap, so its output stays reproducible;
- explore: a batch class whose verify rows only a prior priced has every request draft up to
  EXPLORE_K once, to measure them (a prior that overprices rows is otherwise never corrected);
- probe: a request with no draft verified for a while gets one, so text that turns repetitive
  earns drafts again; only where a draft sure to be accepted would pay. Each probe rejected
  whole doubles the wait for the next (up to `probe_every * probe_backoff`), an accepted draft
  resets it, so text that never repeats stops paying for probes while copied text that returns
  is still found. A probe the proposer had no draft for waits its interval again, so probes
  come on schedule with the rest of the request's wave, not alone at each stray match.

A proposer that scores its drafts (`Proposal.confidence`, e.g. suffix drafting) knows per step
which drafts are likely, where a per-position average cannot. For such proposers `min_gains`
sends a floor instead: the draft stage keeps the drafts whose confidence is at least it. The
floor is the break-even gain of a verify row at the plan's rate, divided by the request's
calibration (accepted drafts / the confidence that was verified, blended with the pool's), so a
proposer that overrates a request is trusted less there.

Lossless by construction: k only decides how many drafts are checked, never which token the
target keeps (greedy output is identical; rejection sampling preserves the distribution for any
k chosen from the past). Each step costs O(batch * num_speculative_tokens * log) here, whatever
the output lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.engine.spec.cost import StepCosts
from pipeline.engine.spec.estimate import Acceptance
from pipeline.engine.spec.plan import drain_plan, gains, rate_plan
from pipeline.engine.spec.record import Decision
from pipeline.spec_settings import SpecSettings

EXPLORE_K = 4  # drafts per request in a step that measures a batch class's verify rows


@dataclass(slots=True)
class _Planned:
    """What `choose` computed for its step, kept (not copied) for `decision`."""

    plan: str
    rids: list[str]
    caps: list[int]
    ks: list[int]
    pinned: list[bool] | None = None
    estimates: list[list[float]] | None = None
    gains: list[list[float]] | None = None
    offered: list[float] | None = None


class SpecController:
    """Chooses per-request k each step and learns from each step's outcome."""

    def __init__(self, settings: SpecSettings) -> None:
        self.settings = settings
        self.cost = StepCosts(settings.cost_decay)
        # every request's outcomes, recent first: after a rejection (or before any draft), and
        # in a run (the last verified draft was accepted whole)
        self.pool = Acceptance.empty(settings.num_speculative_tokens)
        self.hot_pool = Acceptance.empty(settings.num_speculative_tokens)
        self._acc: dict[str, Acceptance] = {}
        self._hot: dict[str, Acceptance] = {}  # each request's own in-run estimate
        self.floor = math.inf  # break-even gain of a verify row (tokens); > 1: no draft pays
        self._probing: set[str] = set()  # this step's probes
        self._exploring = False  # this step verifies every draft: its class's rows are unmeasured
        # whether the proposer had a draft for a request asked for one: engine-wide, and each
        # request's own (one position: `mean[0]`)
        self.offer_pool = Acceptance.empty(1)
        self._offers: dict[str, Acceptance] = {}
        self._asked: dict[str, int] = {}  # this step's k > 0
        self._planned: _Planned | None = None  # the last `choose`, for `decision`
        self._rate: float | None = None  # the last rate plan's tokens per second

    def choose(self, rids: list[str], caps: list[int], pinned: list[bool] | None = None,
               remaining: list[int] | None = None) -> list[int]:
        """k per request, each at most its cap (room left under the length limits). A pinned
        request always gets its cap: a seeded sampled request's random stream is keyed by the
        output position a step starts at, so a k that follows measured timings would make its
        output irreproducible (the distribution would still be right). `remaining`: given in a
        drain (the client's last request admitted, none waiting), the most tokens each request
        may still produce (see `drain_plan`)."""
        s = self.settings
        caps = [max(0, min(s.num_speculative_tokens, c)) for c in caps]
        # An engine that never drafts (`draft: none`) has only k = 0 to choose: no plan, so no
        # step-cost fit (a 4x4 least squares a step, a fifth of a batch-1 step's engine time).
        if s.mode == "fixed" or not rids or s.num_speculative_tokens == 0:
            self._planned = _Planned("fixed", rids, caps, caps) if rids else None
            return caps
        accs = [self._state(r) for r in rids]
        self._probing.clear()
        spared = [False] * len(rids)
        if not self.cost.known(len(rids)):  # nothing measured at this batch: a plain step
            ks = [0] * len(rids)
            self.floor = math.inf
            planned = _Planned("off", rids, caps, ks, pinned)
        else:
            pooled = (self.pooled(), self.pooled(run=True))  # once a step, not per request
            ests = [self._estimate(r, *pooled) for r in rids]
            gs = [gains(e, c) for e, c in zip(ests, caps)]
            offered = [self.offered(r) for r in rids]
            ks = self._best(gs, offered)  # also in a drain: it sets the floor (probes, min_gains)
            plan = "rate"
            if remaining is not None:
                # In a drain the batch's end is the objective (`drain_plan`); the margin, a
                # hedge for the other requests' rate under sustained load, does not apply: it
                # would spare the slowest requests, the very ones whose drafts end the batch.
                ks, end = drain_plan(gs, remaining, self.cost.coefficients(len(rids)), offered)
                plan = "drain"
                # a request ending before the batch does, undrafted, gets no probe either; one
                # that sets the batch's end may (its text may turn repetitive)
                spared = [k == 0 and r < end for k, r in zip(ks, remaining)]
            planned = _Planned(plan, rids, caps, ks, pinned, ests, gs, offered)
        # A class whose verify rows only its prior priced (seeded from another batch size, or
        # a tenth of the base) measures them first: every request drafts up to EXPLORE_K, so
        # the fit sees many rows at once; a prior that overprices rows rules out every draft
        # and probe, and plain steps never correct it. Bounded: a class is measured once it has
        # verified about `prior_weight` batches of extra rows, usually in one step, and
        # EXPLORE_K rather than the whole cap keeps that step from being a long one.
        self._exploring = self.cost.known(len(rids)) and not self.cost.rows_measured(len(rids))
        for i, (a, cap) in enumerate(zip(accs, caps)):
            if pinned is not None and pinned[i]:
                ks[i] = cap
            elif self._exploring:
                ks[i] = min(cap, EXPLORE_K)
            elif cap > 0 and a.idle >= a.probe_wait and self.floor <= 1.0 and not spared[i]:
                # a probe only where a draft sure to be accepted would pay for its row (a scored
                # request may have had k > 0 and still no draft past its floor)
                ks[i] = max(ks[i], 1)
                self._probing.add(rids[i])
        self._asked = {r: k for r, k in zip(rids, ks) if k > 0}
        self._planned = planned  # its ks is `ks`, with the overrides above
        return ks

    def decision(self) -> Decision | None:
        """Why the last `choose` chose its ks (call before the step's `observe`, which changes
        what it read); None when it planned no decode. Built on demand: only a step whose span
        is sampled pays for it."""
        p = self._planned
        if p is None:
            return None
        if p.plan == "fixed":
            why = ["plan"] * len(p.rids)
        else:
            why = ["pinned" if p.pinned is not None and p.pinned[i] else
                   "explore" if self._exploring else
                   "probe" if rid in self._probing else "plan" for i, rid in enumerate(p.rids)]
        d = Decision(p.plan, p.rids, p.caps, p.ks, why, floor=self.floor)
        if p.gains is not None and p.estimates is not None:
            d.acceptance = [e[0] if e else 0.0 for e in p.estimates]
            d.gain = [sum(g[:k]) for g, k in zip(p.gains, p.ks)]
            d.next_gain = [g[k] if k < len(g) else 0.0 for g, k in zip(p.gains, p.ks)]
            d.offered = p.offered
            d.rate = self._rate
        batch = len(p.rids)
        if self.cost.known(batch):
            d.costs = base, per_row, per_draft, per_verify = self.cost.coefficients(batch)
            longest = max(p.ks, default=0)
            d.step_s = (base + per_row * sum(p.ks)
                        + (per_draft * longest + per_verify if longest > 0 else 0.0))
        return d

    def min_gains(self, rids: list[str], pinned: list[bool] | None = None) -> list[float]:
        """Per request, the least confidence a scored draft needs to be verified this step (call
        after `choose`): the break-even gain over the request's calibration. 0 (keep every
        draft) in fixed mode or with no drafts at all, for pinned requests and in a step that
        measures its class's rows."""
        s = self.settings
        if s.mode == "fixed" or self._exploring or s.num_speculative_tokens == 0:
            return [0.0] * len(rids)
        pool = self.pool.calibration(1.0, s.prior_weight)
        out = []
        for i, rid in enumerate(rids):
            if pinned is not None and pinned[i]:
                out.append(0.0)
                continue
            if rid in self._probing:  # the proposer's own scores, once: a calibration that
                out.append(self.floor)  # fell too low to verify anything can recover
                continue
            calib = self._state(rid).calibration(pool, s.prior_weight)
            out.append(self.floor / max(calib, 1e-3))
        return out

    def offered(self, rid: str) -> float:
        """How often the proposer had a draft for `rid` when asked: its own record blended with
        the engine-wide one (`prior_weight`), which starts at 1."""
        w = self.settings.prior_weight
        pool = self.offer_pool.estimate([1.0], w)[0]
        own = self._offers.get(rid)
        return pool if own is None else own.estimate([pool], w)[0]

    def pooled(self, run: bool = False) -> list[float]:
        """The engine-wide estimate per position: where a new request starts (`run`: in a run)."""
        s = self.settings
        pool = self.hot_pool if run else self.pool
        return pool.estimate([s.prior] * s.num_speculative_tokens, s.prior_weight, carry=True)

    def estimate(self, rid: str) -> list[float]:
        """A request's current per-position estimate (the pooled one when it is unknown), in
        its current state: acceptance is bimodal (inside a copied run nearly every draft is
        kept, at its edges few are), so one average would draft too little inside runs and
        too much outside them."""
        return self._estimate(rid, self.pooled(), self.pooled(run=True))

    def _estimate(self, rid: str, cold: list[float], hot: list[float]) -> list[float]:
        a = self._acc.get(rid)
        if a is None:
            return cold
        own = self._hot.get(rid) if a.run else a
        if own is None:  # in a run for the first time: nothing of its own seen there yet
            return hot
        return own.estimate(hot if a.run else cold, self.settings.prior_weight)

    def _best(self, gains: list[list[float]], offered: list[float]) -> list[int]:
        batch = len(gains)
        base, per_row, per_draft, per_verify = self.cost.coefficients(batch)
        # the margin prices the slowdown a draft imposes on the batch's other requests: none at
        # batch 1, where the request's own rate is exactly what is maximised
        margin = 1.0 + (self.settings.margin - 1.0) * (batch - 1) / batch
        costs = (base, per_row * margin, per_draft * margin, per_verify * margin)
        ks, rate = rate_plan(gains, offered, costs)
        self._rate = rate
        # a scored draft's row: its own cost and, on average, its share of the longest draft's
        # (the step's fixed cost of verifying is in the plan's rate, not charged to each row)
        self.floor = rate * (costs[1] + costs[2] / batch)
        return ks

    def observe(self, rids: list[str], drafted: list[int], num_tokens: list[int],
                seconds: float | None, expected: list[float] | None = None) -> None:
        """A decode step's outcome: per request drafts verified and tokens produced (accepted
        drafts + 1); `seconds` the measured step time (None: not measured); `expected` the
        confidence the verified drafts had (their sum; None: not scored). A request finished
        meanwhile still teaches the pool but gets no state back (it would never be forgotten)."""
        s = self.settings
        if any(d > 0 for d in drafted):  # time counted in steps that verified a draft
            self.pool.fade(1.0 - s.pool_alpha)
            self.hot_pool.fade(1.0 - s.pool_alpha)
        for i, (rid, d, n) in enumerate(zip(rids, drafted, num_tokens)):
            own = self._acc.get(rid)
            if self._asked.get(rid, 0) > 0:
                self.offer_pool.update(1, int(d > 0), s.pool_alpha)
                if own is not None:
                    offers = self._offers.setdefault(rid, Acceptance.empty(1))
                    offers.update(1, int(d > 0), s.ema_alpha)
            elif rid in self._offers:  # not asked: its record fades back to the pool's, or a
                # copy the proposer had nothing for at its start (asked no more, since drafts
                # cannot shorten it) would never be found copying later
                self._offers[rid].fade(1.0 - s.ema_alpha)
            if own is not None:  # steps without a verified draft, whoever decided it; a probe
                # the proposer had nothing for counts as made, else a due request would probe
                # alone whenever some stray match turned up (a step paying the verify path's
                # fixed cost for one row that is rarely kept), not with the others of its wave
                own.idle = 0 if d > 0 or rid in self._probing else own.idle + 1
            if d > 0:
                run = own is not None and own.run
                (self.hot_pool if run else self.pool).update(d, n - 1, s.pool_alpha)
                if own is not None:
                    table = self._hot.get(rid) if run else own
                    if table is None:  # its first step observed in a run
                        table = self._hot[rid] = Acceptance.empty(s.num_speculative_tokens)
                    table.update(d, n - 1, s.ema_alpha)
                    probed = rid in self._probing
                    # a lone probe kept is a match, not yet a run: entered on it, a request
                    # would draft the pooled in-run length, learned on copies, on a chance match
                    own.run = n - 1 >= d and not probed
                    if n > 1:
                        own.probe_wait = s.probe_every
                    elif probed:
                        own.probe_wait = min(2 * own.probe_wait, s.probe_every * s.probe_backoff)
                if expected is not None and expected[i] is not None:
                    accepted = min(n - 1, d)
                    self.pool.calibrate(expected[i], accepted, 1.0 - s.pool_alpha)
                    if own is not None:
                        own.calibrate(expected[i], accepted, 1.0 - s.ema_alpha)
        if seconds is not None and rids:
            self.cost.observe(len(rids), len(rids) + sum(drafted), max(drafted, default=0),
                              seconds)

    def forget(self, rid: str) -> None:
        self._acc.pop(rid, None)
        self._hot.pop(rid, None)
        self._offers.pop(rid, None)

    @property
    def tracked(self) -> int:
        """Requests with state here (the running ones)."""
        return len(self._acc)

    def _state(self, rid: str) -> Acceptance:
        a = self._acc.get(rid)
        if a is None:
            a = self._acc[rid] = Acceptance.empty(self.settings.num_speculative_tokens)
            a.probe_wait = self.settings.probe_every
        return a
