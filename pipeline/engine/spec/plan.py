"""The planning math of adaptive speculation: pure functions from estimates and costs to k.

Drafting j tokens yields `1 + sum_{m<=j} S_m` expected tokens, S_m = p[0] * ... * p[m-1]
(`gains`; p from `pipeline.engine.spec.estimate`); the m-th draft's marginal gain S_m never
grows with m, which is what lets both plans below take the best drafts greedily. A step costs
base + per_row * verify rows + per_draft * longest draft + per_verify if any draft is verified
(`pipeline.engine.spec.cost`).

- `rate_plan`: the most expected retained tokens per second for the whole batch: the objective
  under sustained load, where a request that finishes sooner only hands its slot to the next.
- `drain_plan`: the soonest end of the batch: the objective once the last request of a batch job
  is admitted and nothing waits.

No state, no I/O: both plans are property-tested against brute-force references
(tests/engine/test_spec_control.py).
"""

from __future__ import annotations

import numpy as np


def drain_plan(gains: list[list[float]], remaining: list[int],
               costs: tuple[float, float, float, float],
               offered: list[float]) -> tuple[list[int], float]:
    """In a drain, the k per request that brings the batch's expected end soonest, and that end
    (in steps).

    Request i ends after remaining_i / (1 + o_i G_i(k)) steps (G_i(k): its first k drafts'
    gains; o_i (`offered`): how often its proposer had a draft when asked), the batch after the
    slowest, each step costing base + per_row * rows + o (per_draft * longest + per_verify)
    (`costs`, as `CostModel.coefficients`; rows: sum o_i k_i, those verified on average; o: the
    most likely drafting request's o_i, since a step with no draft offered verifies none). At
    batch 1 with o = 1 this is `rate_plan`'s plan (the request's own rate).

    Nothing waits for a slot, so a request's tokens count only through the batch's end: for
    every candidate end S (a request's steps at some k) each request drafts the fewest that end
    it by S, and the plan keeps the S with the least S x step time. So a request that ends by S
    undrafted drafts nothing (its drafts would only slow every step of the batch), and one on
    the critical path drafts wherever its gain outweighs its rows' share of the step, far below
    the break-even of a server's rate: its draft shortens the whole batch. `offered` matters
    here too: a request whose proposer rarely has a draft would otherwise look as if drafts
    could shorten it, and the others would draft to end with it."""
    width = max(len(g) for g in gains) + 1
    # steps[i, k]: request i's expected steps with k drafts; -inf past its cap (never needed)
    steps = np.full((len(gains), width), -np.inf)
    for i, (g, r, o) in enumerate(zip(gains, remaining, offered)):
        steps[i, :len(g) + 1] = r / (1.0 + o * np.concatenate(([0.0], np.cumsum(g))))
    soonest = max(float(steps[i, len(g)]) for i, g in enumerate(gains))
    ends = np.unique(steps[steps >= soonest])  # ascending: the earliest feasible end first
    # Steps fall with k, so the drafts a request needs to end by S are its entries above S: over
    # every entry sorted by steps, falling, the first c(S) are those above S, and a plan's
    # rows, longest draft and likeliest drafting request are running sums and maxima over them:
    # O(n log n), n = batch * (num_speculative_tokens + 1), where a grid of every end and every
    # entry would be n^2 and dominate a large batch's step.
    finite = np.isfinite(steps)
    order = np.argsort(-steps[finite], kind="stable")
    values = steps[finite][order]
    o = np.repeat(np.asarray(offered, dtype=float), finite.sum(axis=1))[order]
    k_plus_1 = (np.nonzero(finite)[1] + 1)[order]
    above = len(values) - np.searchsorted(values[::-1], ends, side="right")  # c(S)
    rows = np.concatenate(([0.0], np.cumsum(o)))[above]
    longest = np.concatenate(([0], np.maximum.accumulate(k_plus_1)))[above]
    verifies = np.concatenate(([0.0], np.maximum.accumulate(o)))[above]
    base, per_row, per_draft, per_verify = costs
    time = ends * (base + per_row * rows + verifies * (per_draft * longest + per_verify))
    # ties (a draft that gains nothing) go to the later end, the fewer rows
    end = ends[len(ends) - 1 - int(np.argmin(time[::-1]))]
    return (steps > end).sum(axis=1).tolist(), float(end)


def rate_plan(gains: list[list[float]], offered: list[float],
              costs: tuple[float, float, float, float]) -> tuple[list[int], float]:
    """The k per request with the most expected retained tokens per second for the whole batch,
    and that rate.

    `costs` as `CostModel.coefficients` (base: a plain step of the batch). For each cap K on the
    longest draft the best rows are the largest gains (S_m falls with m, so a plan is a prefix of
    every candidate draft sorted by gain); all caps are scored in one 2-D pass. A request asked
    for k drafts verifies them only when its proposer has one (`offered`, o_i): it brings
    o_i * S_m tokens for o_i rows, and the step pays the verify path's fixed cost
    (per_verify + per_draft * K) only when some asked request has a draft, 1 - prod(1 - o_i).
    Pricing every asked request as if it verified its drafts would charge the fixed cost to
    steps where the drafts rarely come, and one lone draft would then pay it alone."""
    batch = len(gains)
    base, per_row, per_draft, per_verify = costs
    best, best_rate = [0] * batch, batch / base
    g = np.array([x for gs in gains for x in gs], dtype=float)
    if not len(g):
        return best, best_rate
    pos = np.concatenate([np.arange(len(gs)) for gs in gains])
    req = np.repeat(np.arange(batch), [len(gs) for gs in gains])
    # every candidate draft once, largest gain first (ties: earlier position, then request)
    order = np.lexsort((req, pos, -g))
    gain, pos, req = g[order], pos[order], req[order]
    o = np.clip(np.asarray(offered, dtype=float), 0.0, 1.0)[req]
    # log P(no request of a prefix has a draft), lowered at each request's first draft
    none_log = np.where(pos == 0, np.log1p(-np.minimum(o, 1.0 - 1e-12)), 0.0)
    # row L - 1: the plans whose longest draft is at most L, as prefixes of the candidates
    # within that cap (a candidate past the cap adds 0 to the running sums and is never picked)
    longest = np.arange(1, int(pos.max()) + 2)[:, None]
    taken = pos[None, :] < longest
    tokens = batch + np.cumsum(np.where(taken, o * gain, 0.0), axis=1)
    verifies = 1.0 - np.exp(np.cumsum(np.where(taken, none_log, 0.0), axis=1))
    rows = np.cumsum(np.where(taken, o, 0.0), axis=1)
    rate = tokens / (base + verifies * (per_verify + per_draft * longest) + per_row * rows)
    rate = np.where(taken, rate, -np.inf)
    cap, top = np.unravel_index(int(np.argmax(rate)), rate.shape)  # the first of the best
    if rate[cap, top] > best_rate:
        plan = req[:top + 1][taken[cap, :top + 1]]
        best, best_rate = np.bincount(plan, minlength=batch).tolist(), float(rate[cap, top])
    return best, best_rate


def gains(p: list[float], k: int) -> list[float]:
    """Expected extra tokens of the 1st..k-th draft: S_1..S_k."""
    out, s = [], 1.0
    for i in range(k):
        s *= p[i]
        out.append(s)
    return out
