"""The adaptive controller: how many drafts each request verifies this step (k, 0 allowed).

Acceptance per request and position starts from an engine-wide pool and moves to the request's
own, one estimate inside a copied run and one outside (acceptance is bimodal). The rate plan
maximises the batch's tokens per second, pricing a draft up to `margin` times at batch > 1; a
batch job's drain brings its end soonest. Overrides: pinned (a seeded request gets its cap, so it
stays reproducible), explore (measure a batch class's rows), probe (backing off on failure).
A proposer that scores its drafts gets a confidence floor (`min_gains`). Lossless: k never
decides which token is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.engine.spec.cost import StepCosts
from pipeline.engine.spec.estimate import Acceptance
from pipeline.engine.spec.plan import drain_plan, gains, rate_plan
from pipeline.engine.spec.record import Decision
from pipeline.spec_settings import SpecSettings

EXPLORE_K = 4


@dataclass(slots=True)
class _Planned:
    plan: str
    rids: list[str]
    caps: list[int]
    ks: list[int]
    pinned: list[bool] | None = None
    estimates: list[list[float]] | None = None
    gains: list[list[float]] | None = None
    offered: list[float] | None = None


class SpecController:
    def __init__(self, settings: SpecSettings) -> None:
        self.settings = settings
        self.cost = StepCosts(settings.cost_decay)
        self.pool = Acceptance.empty(settings.num_speculative_tokens)
        self.hot_pool = Acceptance.empty(settings.num_speculative_tokens)
        self._acc: dict[str, Acceptance] = {}
        self._hot: dict[str, Acceptance] = {}
        self.floor = math.inf  # break-even gain of a verify row; > 1: no draft pays
        self._probing: set[str] = set()
        self._exploring = False
        self.offer_pool = Acceptance.empty(1)
        self._offers: dict[str, Acceptance] = {}
        self._asked: dict[str, int] = {}
        self._planned: _Planned | None = None
        self._rate: float | None = None

    def choose(self, rids: list[str], caps: list[int], pinned: list[bool] | None = None,
               remaining: list[int] | None = None) -> list[int]:
        """`remaining`, in a drain: the most tokens each request may still produce."""
        s = self.settings
        caps = [max(0, min(s.num_speculative_tokens, c)) for c in caps]
        if s.mode == "fixed" or not rids or s.num_speculative_tokens == 0:
            self._planned = _Planned("fixed", rids, caps, caps) if rids else None
            return caps
        accs = [self._state(r) for r in rids]
        self._probing.clear()
        spared = [False] * len(rids)
        if not self.cost.known(len(rids)):
            ks = [0] * len(rids)
            self.floor = math.inf
            planned = _Planned("off", rids, caps, ks, pinned)
        else:
            pooled = (self.pooled(), self.pooled(run=True))
            ests = [self._estimate(r, *pooled) for r in rids]
            gs = [gains(e, c) for e, c in zip(ests, caps)]
            offered = [self.offered(r) for r in rids]
            ks = self._best(gs, offered)  # also in a drain: it sets the floor (probes, min_gains)
            plan = "rate"
            if remaining is not None:
                # no margin: it would spare the slowest requests, whose drafts end the batch
                ks, end = drain_plan(gs, remaining, self.cost.coefficients(len(rids)), offered)
                plan = "drain"
                spared = [k == 0 and r < end for k, r in zip(ks, remaining)]
            planned = _Planned(plan, rids, caps, ks, pinned, ests, gs, offered)
        # a prior that overprices rows rules out the drafts that would correct it: measure first
        self._exploring = self.cost.known(len(rids)) and not self.cost.rows_measured(len(rids))
        for i, (a, cap) in enumerate(zip(accs, caps)):
            if pinned is not None and pinned[i]:
                ks[i] = cap
            elif self._exploring:
                ks[i] = min(cap, EXPLORE_K)
            elif cap > 0 and a.idle >= a.probe_wait and self.floor <= 1.0 and not spared[i]:
                ks[i] = max(ks[i], 1)
                self._probing.add(rids[i])
        self._asked = {r: k for r, k in zip(rids, ks) if k > 0}
        self._planned = planned
        return ks

    def decision(self) -> Decision | None:
        """Why the last `choose` chose its ks; call before `observe`, which changes what it read."""
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
        """Per request, the break-even gain over its calibration (call after `choose`)."""
        s = self.settings
        if s.mode == "fixed" or self._exploring or s.num_speculative_tokens == 0:
            return [0.0] * len(rids)
        pool = self.pool.calibration(1.0, s.prior_weight)
        out = []
        for i, rid in enumerate(rids):
            if pinned is not None and pinned[i]:
                out.append(0.0)
                continue
            if rid in self._probing:  # uncalibrated, so a calibration too low can recover
                out.append(self.floor)
                continue
            calib = self._state(rid).calibration(pool, s.prior_weight)
            out.append(self.floor / max(calib, 1e-3))
        return out

    def offered(self, rid: str) -> float:
        w = self.settings.prior_weight
        pool = self.offer_pool.estimate([1.0], w)[0]
        own = self._offers.get(rid)
        return pool if own is None else own.estimate([pool], w)[0]

    def pooled(self, run: bool = False) -> list[float]:
        s = self.settings
        pool = self.hot_pool if run else self.pool
        return pool.estimate([s.prior] * s.num_speculative_tokens, s.prior_weight, carry=True)

    def estimate(self, rid: str) -> list[float]:
        return self._estimate(rid, self.pooled(), self.pooled(run=True))

    def _estimate(self, rid: str, cold: list[float], hot: list[float]) -> list[float]:
        a = self._acc.get(rid)
        if a is None:
            return cold
        own = self._hot.get(rid) if a.run else a
        if own is None:
            return hot
        return own.estimate(hot if a.run else cold, self.settings.prior_weight)

    def _best(self, gains: list[list[float]], offered: list[float]) -> list[int]:
        batch = len(gains)
        base, per_row, per_draft, per_verify = self.cost.coefficients(batch)
        margin = 1.0 + (self.settings.margin - 1.0) * (batch - 1) / batch
        costs = (base, per_row * margin, per_draft * margin, per_verify * margin)
        ks, rate = rate_plan(gains, offered, costs)
        self._rate = rate
        self.floor = rate * (costs[1] + costs[2] / batch)
        return ks

    def observe(self, rids: list[str], drafted: list[int], num_tokens: list[int],
                seconds: float | None, expected: list[float] | None = None) -> None:
        # a request finished meanwhile teaches only the pool
        s = self.settings
        if any(d > 0 for d in drafted):
            self.pool.fade(1.0 - s.pool_alpha)
            self.hot_pool.fade(1.0 - s.pool_alpha)
        for i, (rid, d, n) in enumerate(zip(rids, drafted, num_tokens)):
            own = self._acc.get(rid)
            if self._asked.get(rid, 0) > 0:
                self.offer_pool.update(1, int(d > 0), s.pool_alpha)
                if own is not None:
                    offers = self._offers.setdefault(rid, Acceptance.empty(1))
                    offers.update(1, int(d > 0), s.ema_alpha)
            elif rid in self._offers:  # not asked: fades back, so it gets asked again
                self._offers[rid].fade(1.0 - s.ema_alpha)
            if own is not None:  # a probe without a draft counts as made: probes stay in waves
                own.idle = 0 if d > 0 or rid in self._probing else own.idle + 1
            if d > 0:
                run = own is not None and own.run
                (self.hot_pool if run else self.pool).update(d, n - 1, s.pool_alpha)
                if own is not None:
                    table = self._hot.get(rid) if run else own
                    if table is None:
                        table = self._hot[rid] = Acceptance.empty(s.num_speculative_tokens)
                    table.update(d, n - 1, s.ema_alpha)
                    probed = rid in self._probing
                    # a lone probe kept is a chance match, not yet a run
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
        return len(self._acc)

    def _state(self, rid: str) -> Acceptance:
        a = self._acc.get(rid)
        if a is None:
            a = self._acc[rid] = Acceptance.empty(self.settings.num_speculative_tokens)
            a.probe_wait = self.settings.probe_every
        return a
