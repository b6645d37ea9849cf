"""How many drafts each request verifies this step (k, 0 allowed): adaptive speculation.

Per draft position the controller estimates p[i] = P(position i accepted | position i-1
accepted), from positions the verifier actually saw. A new request starts from the pooled
estimate of recent requests (an engine-wide EMA over every request's outcomes); its own
observations take over as they accumulate (a Beta-style blend: the pool counts as
`prior_weight` observations). In the pool, a position nobody has drafted yet is taken to be no
worse than the one before it, so after copied text a new request drafts long from its first step.
The pools' evidence fades each step that verifies a draft (by 1 - `pool_alpha`), so a position
nobody has drafted lately falls back to that carried prior too: chat requests rarely reach a deep
position or a run, and the ~1.0 that copies left there would otherwise have them draft 4-8 tokens
that keep 30%. A step with no draft verified says nothing about any position and leaves the pools
as they are: at batch 1 a chat request between two copies decodes ~60 plain steps, and a fade per
step had the next copy start its runs from the prior (mix at batch 1: 1,509 steps against 1,486
for fixed k = 8, the same steps as k = 8 with no fade).
Each request keeps two such estimates, by the outcome of its last verified draft: accepted whole
(inside a run: copied text goes on) or not (at a run's edge, or never in one); a probe (below)
kept whole counts for the first estimate but does not start a run. Acceptance is
bimodal on copy-like text, and one average drafts too little inside runs and too much between
them (copy at batch 8: 2.2 tokens a verify against 2.7 for fixed k = 4, same rows verified).

Drafting j tokens yields `1 + sum_{m<=j} S_m` expected tokens, S_m = p[0] * ... * p[m-1]; the
m-th draft's marginal gain S_m never grows with m. The engine measures what a step costs
(`CostModel`: seconds ~ base + per_row * verify rows + per_draft * longest draft + a fixed cost
if any draft is verified, one model per batch class, `StepCosts`, since what a row costs depends
on the batch), so for each cap K on the longest draft the best rows are the largest gains; the
plan keeps the (K, rows) with the most expected retained tokens per second for the whole batch
(`rate_plan`; a request's drafts weighed by how often its proposer has one when asked, since a
step pays the verify path's fixed cost only when some request has a draft),
with every draft's cost counted up to `margin` times at batch > 1: a draft is verified only where
its expected gain clearly pays, since its verify row slows every other request in the batch (the
factor grows with the share of the batch that is other requests, 1 + (margin - 1) * (b - 1) / b;
at batch 1 the request's own rate is the whole objective). Every request's tokens count alike:
under sustained load a request that finishes sooner hands its slot to the next one, and a server
cannot tell a drain from a lull between arrivals (weighing gains by how close a request is to
ending the batch, tried while the benchmark ran closed waves, starved copies in a closed loop).
A batch job can: it marks its last request, and once that one is admitted and nothing waits the
batch drains. Then only the batch's end matters (`drain_plan`): a request sure to finish before
it drafts nothing, and one on the batch's critical path drafts wherever that ends the batch
sooner. A
request with no draft verified for `probe_every` steps gets one, so text that turns repetitive
earns drafts again (only where a draft sure to be accepted would pay: never at a batch where no
draft can). A batch class whose verify rows only its prior priced has every request draft up
to EXPLORE_K (4) once, to measure them. Each probe rejected whole doubles the request's wait for
the next (up to `probe_every * probe_backoff`), an accepted draft resets it: on chat at batch 8
a fixed interval spent 412 verify rows on probes that kept 24% (the break-even there is ~40%),
while copied text that returns is still found within a few dozen steps. A probe the proposer had
no draft for waits its interval again, so probes come on schedule, with the rest of the request's
wave, not alone at each stray match. Each step costs O(batch * max_k * log) here, whatever the
output lengths.

A proposer that scores its drafts (`Proposal.confidence`: the chance drafts 0..j are all
accepted, e.g. suffix drafting) knows, per step, which drafts are likely; a per-position average
cannot (it would keep a long confident suffix draft unverified, or verify a short unlikely one).
For such proposers the controller sends a floor instead (`min_gains`): the draft stage keeps the
drafts whose confidence is at least it. The floor is the break-even gain, the expected tokens a
verify row must bring to pay for itself at the plan's rate (rate * seconds per row), divided by
the request's calibration (accepted drafts / the confidence that was verified: its own, blended
with the pool's, so a proposer that overrates a request is trusted less there). A probe step
takes the proposer's scores as they are: a calibration low enough to keep every draft out would
otherwise never see another verified draft to recover from.

Lossless by construction: k only decides how many drafts are checked, never which token the
target keeps (greedy output is identical; rejection sampling preserves the distribution for any k
chosen from the past).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MODES = ("adaptive", "fixed")
EXPLORE_K = 4  # drafts per request in a step that measures a batch class's verify rows


@dataclass
class SpecSettings:
    mode: str = "adaptive"  # adaptive | fixed (always the most drafts allowed)
    max_k: int = 4  # most drafts per request and step
    ema_alpha: float = 0.25  # weight of the newest observation in the per-position EMA
    prior: float = 0.5  # the pooled acceptance before any draft has been verified
    probe_every: int = 8  # steps at k = 0 before a one-draft probe
    probe_backoff: int = 8  # a rejected probe doubles the wait, up to probe_every * this
    cost_decay: float = 0.97  # per-step decay of the cost model's past observations
    prior_weight: float = 2.0  # observations the pooled estimate counts as in a request's own
    pool_alpha: float = 0.05  # weight of the newest request-step in the engine-wide EMA, and
    # the per-step fade of its evidence
    margin: float = 1.5  # at a large batch a draft's gain must beat its cost by this factor


@dataclass
class Acceptance:
    """Observed conditional acceptance per draft position: the plain mean of the first 1/alpha
    observations, an EMA (newest weight alpha) after that, so no start value has to be
    unlearned; `seen` counts the observations. `idle`: steps in a row without a verified draft."""

    mean: list[float]
    seen: list[float]  # a pool's fade with time (`fade`); a request's are plain counts
    idle: int = 0
    probe_wait: int = 0  # steps without a verified draft before the next probe
    run: bool = False  # the last verified draft was accepted whole (see `SpecController`)
    accepted: float = 0.0  # decayed sums over scored drafts: tokens accepted,
    expected: float = 0.0  # and the confidence the proposer gave them

    @classmethod
    def empty(cls, max_k: int) -> Acceptance:
        return cls([0.0] * max_k, [0] * max_k)

    def update(self, drafted: int, accepted: int, alpha: float) -> None:
        """Positions 0..accepted were tried (0..accepted-1 accepted, `accepted` rejected when
        it was drafted); later positions were never reached and say nothing."""
        for i in range(min(drafted, accepted + 1)):
            self.seen[i] += 1
            weight = max(alpha, 1.0 / self.seen[i])
            self.mean[i] += weight * ((1.0 if i < accepted else 0.0) - self.mean[i])

    def fade(self, factor: float) -> None:
        """Older observations count less in `estimate` (the pools, once a step that verified a
        draft): a position not drafted lately falls back towards its carried prior. Without it
        the in-run pool and the deep positions learned on copies kept their ~1.0 through later
        chat cells (chat reaches them rarely), and chat requests drafted 4-8 tokens that kept 30%
        of them."""
        self.seen = [n * factor for n in self.seen]

    def calibrate(self, expected: float, accepted: int, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.expected = decay * self.expected + expected

    def calibration(self, prior: float, prior_weight: float) -> float:
        """Accepted / expected, the prior counting as `prior_weight` expected tokens."""
        return (self.accepted + prior_weight * prior) / (self.expected + prior_weight)

    def estimate(self, prior: list[float], prior_weight: float,
                 carry: bool = False) -> list[float]:
        """Per position (w * prior + n * mean) / (w + n), n = observations. `carry` (the pool):
        a position's prior is at least the estimate before it, so a position nobody has drafted
        yet is taken to be no worse than the one before it (acceptance grows along a copied run)."""
        out, before = [], 0.0
        for prior_i, mean, n in zip(prior, self.mean, self.seen):
            p = max(prior_i, before) if carry else prior_i
            before = (prior_weight * p + n * mean) / (prior_weight + n)
            out.append(before)
        return out


def drain_plan(gains: list[list[float]], remaining: list[int],
               costs: tuple[float, float, float, float],
               offered: list[float]) -> tuple[list[int], float]:
    """In a drain, the k per request that brings the batch's expected end soonest, and that end
    (in steps). Request i
    ends after remaining_i / (1 + o_i G_i(k)) steps (G_i(k): its first k drafts' gains; o_i
    (`offered`): how often its proposer had a draft when asked), the batch after the slowest,
    each step costing base + per_row * rows + o (per_draft * longest + per_verify) (`costs`, as
    `CostModel.coefficients`; rows: sum o_i k_i, those verified on average; o: the most likely
    drafting request's o_i, a step with no draft offered verifies none). At batch 1 with o = 1
    this is the plan of `SpecController._best` (the request's own rate). Nothing waits for a
    slot, so a request's tokens count only through the batch's end: for every candidate end S
    (a request's steps at some k) each request drafts the fewest that end it by S, and the plan
    keeps the S with the least S x step time. A request that ends by S undrafted drafts
    nothing: in a wave of copies and chats at batch 32 every mode ran 64 steps (the chats'
    length), and drafting the copies only made each step slower (adaptive 0.94x target-only).
    A request on the critical path drafts wherever its gain outweighs its rows' share of the
    step, far below the break-even of a server's rate: one slow copy's draft shortens the whole
    batch. Without `offered`, chats that the n-gram proposer rarely had a draft for looked as if
    drafts would shorten them, and the copies drafted to end with them: mix at batch 32
    verified 976 drafts in the same 64 steps a wave (0.971x target-only)."""
    width = max(len(g) for g in gains) + 1
    # steps[i, k]: request i's expected steps with k drafts; -inf past its cap (never needed)
    steps = np.full((len(gains), width), -np.inf)
    for i, (g, r, o) in enumerate(zip(gains, remaining, offered)):
        steps[i, :len(g) + 1] = r / (1.0 + o * np.concatenate(([0.0], np.cumsum(g))))
    soonest = max(float(steps[i, len(g)]) for i, g in enumerate(gains))
    ends = np.unique(steps[steps >= soonest])  # ascending: the earliest feasible end first
    # Steps fall with k, so the drafts a request needs to end by S are its entries above S: over
    # every entry sorted by steps, falling, the first c(S) are those above S, and a plan's
    # rows, longest draft and likeliest drafting request are running sums and maxima over them
    # (O(n log n), n = batch * (max_k + 1); a grid of every end and entry is n^2: 19M cells
    # and 11 ms a step at batch 256 and k = 16, against 2 ms).
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
    and that rate. `costs` as `CostModel.coefficients` (base: a plain step of the batch). For
    each cap K on the longest draft the best rows are the largest gains (S_m falls with m, so
    a plan is a prefix of every candidate draft sorted by gain): O(batch * max_k) a cap.
    A request asked for k drafts verifies them only when its proposer has one (`offered`,
    o_i): it brings o_i * S_m tokens for o_i rows, and the step pays the verify path's fixed
    cost (per_verify + per_draft * K) only when some asked request has a draft,
    1 - prod(1 - o_i). Priced as if every asked request verified its drafts, chat at batch 8
    asked 6-10 requests a step for a draft of 2 that the n-gram proposer had about one step in
    ten: the one that came paid the fixed cost alone (a step with 1-2 drafts took 91 ms against
    85 for a plain one), and the drafts kept (52%) saved 1% of the steps for as much time."""
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


@dataclass
class CostModel:
    """Seconds of one decode step ~ base + per_row * rows + per_draft * longest draft +
    per_verify if any draft is verified, fitted by exponentially weighted least squares over
    (rows, longest draft) observations. `per_verify` is the verify path's fixed cost: at batch 1
    on CPU a step verifying one draft took 100 ms, one verifying 8 took 120 and a plain decode 60
    (SmolLM2, one thread: two rows leave the matrix-vector kernels), so a line through the rows
    priced a 1-draft step at 67 ms and the plan kept verifying 1-3 drafts that did not pay. The
    first observation sets the scale of a prior: the slopes given (`prior_slopes`: per row, per
    draft, per verify), or else a verify row costing a tenth of the base and no fixed cost.
    `rows_measured` once the rows verified beyond the batch, counted in batches, weigh as much as
    one of the prior's points (both decay alike): until then what a row costs is the prior's
    word, since plain steps all have the same rows. From then on the prior keeps a tenth of its
    weight: its points lie far out on the row axis (1 and 4 x batch + 4 rows), and at full weight
    they outweighed a measured step of 288 rows at batch 32 (11.7 ms a row from batch 2's slope
    stayed 10.4 ms where the step said 1.6)."""

    decay: float = 0.97
    prior_weight: float = 2.0
    prior_slopes: tuple[float, float, float] | None = None
    _xx: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))
    _xy: np.ndarray = field(default_factory=lambda: np.zeros(4))
    _coef: np.ndarray | None = None
    _prior_xx: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))  # the prior's
    _prior_xy: np.ndarray = field(default_factory=lambda: np.zeros(4))  # share of _xx, _xy
    _prior_left: float = 0.0  # one prior point's weight, decayed like the observations
    _verified: float = 0.0  # decayed verify rows beyond the batch, in batches

    def observe(self, rows: int, longest: int, seconds: float, verified: float = 0.0) -> None:
        if self._coef is None:  # the scale: a prior from the first observation
            if self.prior_slopes is None:
                base = seconds / (1.0 + 0.1 * rows)
                per_row, per_draft, per_verify = 0.1 * base, 0.0, 0.0
            else:
                per_row, per_draft, per_verify = self.prior_slopes
                base = max(seconds - per_row * rows - per_draft * longest
                           - per_verify * (longest > 0), 0.1 * seconds)
            # plain steps at two row counts (per row), drafted ones of 1 and 4 (per draft and
            # the fixed cost apart)
            for r, k in ((1, 0), (4 * rows + 4, 0), (rows, 4), (rows, 1)):
                self._add(r, k, base + per_row * r + per_draft * k + per_verify * (k > 0),
                          self.prior_weight)
            self._prior_xx, self._prior_xy = self._xx.copy(), self._xy.copy()
            self._prior_left = self.prior_weight
        was_measured = self.rows_measured
        for a in (self._xx, self._xy, self._prior_xx, self._prior_xy):
            a *= self.decay
        self._prior_left *= self.decay
        self._verified = self._verified * self.decay + verified
        self._add(rows, longest, seconds, 1.0)
        if self.rows_measured and not was_measured:  # the prior steps back
            self._xx -= 0.9 * self._prior_xx
            self._xy -= 0.9 * self._prior_xy
            self._prior_xx *= 0.1
            self._prior_xy *= 0.1
            self._prior_left *= 0.1
        self._coef = self._fit()

    def _fit(self) -> np.ndarray:
        """Least squares with costs never negative: a slope the fit wants below 0 is left out
        and the rest refitted (clipping it instead would keep the other slope's share of it:
        at batch 1 rows and the longest draft move together, and a clipped split overprices
        every draft)."""
        active = [0, 1, 2, 3]
        while True:
            coef = np.zeros(4)
            sub = np.ix_(active, active)
            coef[active] = np.linalg.lstsq(self._xx[sub], self._xy[active], rcond=None)[0]
            negative = [i for i in active[1:] if coef[i] < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda i: coef[i]))
        coef[0] = max(coef[0], 1e-6)
        return coef

    def _add(self, rows: int, longest: int, seconds: float, weight: float) -> None:
        x = np.array([1.0, float(rows), float(longest), float(longest > 0)])
        self._xx += weight * np.outer(x, x)
        self._xy += weight * seconds * x

    @property
    def known(self) -> bool:
        return self._coef is not None

    @property
    def rows_measured(self) -> bool:
        return self.known and self._verified >= self._prior_left

    def coefficients(self, batch: int) -> tuple[float, float, float, float]:
        """(seconds of a plain decode of `batch` rows, per extra verify row, per draft step,
        a step's fixed cost of verifying any draft)."""
        assert self._coef is not None
        c0, c1, c2, c3 = (float(c) for c in self._coef)
        return c0 + c1 * batch, c1, c2, c3


class StepCosts:
    """A CostModel per batch class (1, 2-3, 4-7, 8-15, ...): what a verify row costs depends on
    the batch (on CPU the row count picks the matmul kernel: one more row at batch 1 costs more
    than at batch 8), so a cost learned at one batch size never prices another's rows for long.
    A class knows nothing until a step of its own was measured; its prior slopes are the nearest
    known class's. Its own plain steps say nothing of what a row costs (every one has the same
    rows), and a prior that overprices rows is never corrected, since no row is then verified:
    at batch 32 a tenth of the base priced a row at ~10 ms where one costs ~3, and copy text
    was drafted nothing while fixed k = 2 ran 6% faster than target-only. A nearest class at a
    much smaller batch overprices rows the same way (copy at batch 32, seeded from the warm-up's
    batch 2, drafted nothing), so a class that has not measured its verify rows
    (`rows_measured`) measures them before it plans (SpecController.choose)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self._models: dict[int, CostModel] = {}

    def observe(self, batch: int, rows: int, longest: int, seconds: float) -> None:
        key = batch.bit_length()
        if key not in self._models:
            known = [k for k, m in self._models.items() if m.known]
            slopes = None
            if known:
                near = self._models[min(known, key=lambda k: (abs(k - key), -k))]
                slopes = near.coefficients(1)[1:]
            self._models[key] = CostModel(self.decay, prior_slopes=slopes)
        self._models[key].observe(rows, longest, seconds, verified=(rows - batch) / batch)

    def known(self, batch: int) -> bool:
        m = self._models.get(batch.bit_length())
        return m is not None and m.known

    def rows_measured(self, batch: int) -> bool:
        m = self._models.get(batch.bit_length())
        return m is not None and m.rows_measured

    def coefficients(self, batch: int) -> tuple[float, float, float, float]:
        return self._models[batch.bit_length()].coefficients(batch)


class SpecController:
    """Chooses per-request k each step and learns from each step's outcome."""

    def __init__(self, settings: SpecSettings) -> None:
        self.settings = settings
        self.cost = StepCosts(settings.cost_decay)
        # every request's outcomes, recent first: after a rejection (or before any draft), and
        # in a run (the last verified draft was accepted whole)
        self.pool = Acceptance.empty(settings.max_k)
        self.hot_pool = Acceptance.empty(settings.max_k)
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

    def choose(self, rids: list[str], caps: list[int], pinned: list[bool] | None = None,
               remaining: list[int] | None = None) -> list[int]:
        """k per request, each at most its cap (room left under the length limits). A pinned
        request always gets its cap: a seeded sampled request's random stream is keyed by the
        output position a step starts at, so a k that follows measured timings would make its
        output irreproducible (the distribution would still be right). `remaining`: given in a
        drain (the client's last request admitted, none waiting), the most tokens each request
        may still produce (see `drain_plan`)."""
        s = self.settings
        caps = [max(0, min(s.max_k, c)) for c in caps]
        if s.mode == "fixed" or not rids:
            return caps
        accs = [self._state(r) for r in rids]
        self._probing.clear()
        spared = [False] * len(rids)
        if not self.cost.known(len(rids)):  # nothing measured at this batch: a plain step
            ks = [0] * len(rids)
            self.floor = math.inf
        else:
            pooled = (self.pooled(), self.pooled(run=True))  # once a step, not per request
            gs = [gains(self._estimate(r, *pooled), c) for r, c in zip(rids, caps)]
            offered = [self.offered(r) for r in rids]
            ks = self._best(gs, offered)  # also in a drain: it sets the floor (probes, min_gains)
            if remaining is not None:
                # In a drain the batch's end is the objective (`drain_plan`); the margin, a
                # hedge for the other requests' rate under sustained load, does not apply. With
                # it, and a plan sparing every request that ends before the slowest one, copy
                # at batch 32 (one wave) planned no draft for its slowest requests, ties spared
                # every request: 1.10 tokens a verify, 0.93x fixed k = 2.
                ks, end = drain_plan(gs, remaining, self.cost.coefficients(len(rids)), offered)
                # a request ending before the batch does, undrafted, gets no probe either; one
                # that sets the batch's end may (its text may turn repetitive)
                spared = [k == 0 and r < end for k, r in zip(ks, remaining)]
        # A class whose verify rows only its prior priced (seeded from another batch size, or
        # a tenth of the base) measures them first: every request drafts up to EXPLORE_K, so
        # the fit sees many rows at once (copy at batch 32 seeded from the warm-up's batch 2
        # priced a row at 12-17 ms where it costs 2-6, ruled out every draft and probe, and plain
        # steps never corrected it). Bounded: a class is measured once it has verified about
        # `prior_weight` batches of extra rows, usually in one step; drafting the whole cap
        # there (16) made that step 544 rows at batch 32, ~1.3 s of a 19 s wave.
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
        return ks

    def min_gains(self, rids: list[str], pinned: list[bool] | None = None) -> list[float]:
        """Per request, the least confidence a scored draft needs to be verified this step (call
        after `choose`): the break-even gain over the request's calibration. 0 (keep every
        draft) in fixed mode, for pinned requests and in a step that measures its class's rows."""
        s = self.settings
        if s.mode == "fixed" or self._exploring:
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
        return pool.estimate([s.prior] * s.max_k, s.prior_weight, carry=True)

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
                # alone whenever some stray match turned up (chat: a step paying the longest
                # draft for one row that is rarely kept), and not with the others of its wave
                own.idle = 0 if d > 0 or rid in self._probing else own.idle + 1
            if d > 0:
                run = own is not None and own.run
                (self.hot_pool if run else self.pool).update(d, n - 1, s.pool_alpha)
                if own is not None:
                    table = self._hot.get(rid) if run else own
                    if table is None:  # its first step observed in a run
                        table = self._hot[rid] = Acceptance.empty(s.max_k)
                    table.update(d, n - 1, s.ema_alpha)
                    probed = rid in self._probing
                    # a lone probe kept is a match, not yet a run: entered on it, a chat request
                    # drafted the pooled in-run length (8, learned on copies) and lost all of it
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
            a = self._acc[rid] = Acceptance.empty(self.settings.max_k)
            a.probe_wait = self.settings.probe_every
        return a


def validate(settings: SpecSettings) -> None:
    """ValueError naming the config field (speculation, spec_*)."""
    if settings.mode not in MODES:
        raise ValueError(f"speculation: must be one of {', '.join(MODES)}, got {settings.mode!r}")
    for name, value in (("spec_ema_alpha", settings.ema_alpha), ("spec_prior", settings.prior),
                        ("spec_cost_decay", settings.cost_decay),
                        ("spec_pool_alpha", settings.pool_alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 < value <= 1:
            raise ValueError(f"{name}: must be a number in (0, 1], got {value!r}")
    for name, value in (("spec_probe_every", settings.probe_every),
                        ("spec_probe_backoff", settings.probe_backoff)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    margin = settings.margin
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 1:
        raise ValueError(f"spec_margin: must be a number >= 1, got {margin!r}")
    weight = settings.prior_weight
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
        raise ValueError(f"spec_prior_weight: must be a number >= 0, got {weight!r}")
