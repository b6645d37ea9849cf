"""Planning math, pure: j drafts yield 1 + S_1 + ... + S_j tokens, S_m = p[0] * ... * p[m-1];
S_m never grows with m, so both plans take the best drafts greedily."""

from __future__ import annotations

import numpy as np


def drain_plan(gains: list[list[float]], remaining: list[int],
               costs: tuple[float, float, float, float],
               offered: list[float]) -> tuple[list[int], float]:
    """The k per request that ends the batch soonest, and that end in steps: per candidate end S
    each request drafts the fewest that end it by S; the S with the least S x step time wins."""
    width = max(len(g) for g in gains) + 1
    # steps[i, k]: request i's expected steps with k drafts; -inf past its cap
    steps = np.full((len(gains), width), -np.inf)
    for i, (g, r, o) in enumerate(zip(gains, remaining, offered)):
        steps[i, :len(g) + 1] = r / (1.0 + o * np.concatenate(([0.0], np.cumsum(g))))
    soonest = max(float(steps[i, len(g)]) for i, g in enumerate(gains))
    ends = np.unique(steps[steps >= soonest])
    # steps fall with k: over every entry sorted falling, the first c(S) are those above S, so a
    # plan's rows, longest draft and o are running sums and maxima: O(n log n), not n^2
    finite = np.isfinite(steps)
    order = np.argsort(-steps[finite], kind="stable")
    values = steps[finite][order]
    o = np.repeat(np.asarray(offered, dtype=float), finite.sum(axis=1))[order]
    k_plus_1 = (np.nonzero(finite)[1] + 1)[order]
    above = len(values) - np.searchsorted(values[::-1], ends, side="right")
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
    """The k per request with the most expected tokens per second for the batch, and that rate;
    per cap on the longest draft a plan is a prefix of the drafts sorted by gain."""
    batch = len(gains)
    base, per_row, per_draft, per_verify = costs
    best, best_rate = [0] * batch, batch / base
    g = np.array([x for gs in gains for x in gs], dtype=float)
    if not len(g):
        return best, best_rate
    pos = np.concatenate([np.arange(len(gs)) for gs in gains])
    req = np.repeat(np.arange(batch), [len(gs) for gs in gains])
    order = np.lexsort((req, pos, -g))
    gain, pos, req = g[order], pos[order], req[order]
    o = np.clip(np.asarray(offered, dtype=float), 0.0, 1.0)[req]
    # log P(no request of a prefix has a draft), lowered at each request's first draft
    none_log = np.where(pos == 0, np.log1p(-np.minimum(o, 1.0 - 1e-12)), 0.0)
    # row L - 1: the plans whose longest draft is at most L
    longest = np.arange(1, int(pos.max()) + 2)[:, None]
    taken = pos[None, :] < longest
    tokens = batch + np.cumsum(np.where(taken, o * gain, 0.0), axis=1)
    verifies = 1.0 - np.exp(np.cumsum(np.where(taken, none_log, 0.0), axis=1))
    rows = np.cumsum(np.where(taken, o, 0.0), axis=1)
    rate = tokens / (base + verifies * (per_verify + per_draft * longest) + per_row * rows)
    rate = np.where(taken, rate, -np.inf)
    cap, top = np.unravel_index(int(np.argmax(rate)), rate.shape)
    if rate[cap, top] > best_rate:
        plan = req[:top + 1][taken[cap, :top + 1]]
        best, best_rate = np.bincount(plan, minlength=batch).tolist(), float(rate[cap, top])
    return best, best_rate


def gains(p: list[float], k: int) -> list[float]:
    """S_1..S_k."""
    out, s = [], 1.0
    for i in range(k):
        s *= p[i]
        out.append(s)
    return out
