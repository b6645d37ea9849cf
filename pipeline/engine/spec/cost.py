"""What a decode step costs, learned from measured step times: the price side of the plans.

The plans (`pipeline.engine.spec.plan`) weigh expected tokens against seconds, so they need
base + per_row * rows + per_draft * longest draft + per_verify (if any draft is verified) for the
batch at hand. The engine reports each decode step's time (`SpecController.observe`); the
models here fit those coefficients per batch class, recent steps weighing most (`decay`), since
the machine's load and the batch's lengths drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class CostModel:
    """Seconds of one decode step ~ base + per_row * rows + per_draft * longest draft +
    per_verify if any draft is verified, fitted by exponentially weighted least squares over
    (rows, longest draft) observations.

    `per_verify` is the verify path's fixed cost, apart from the rows: on CPU, two rows leave
    the matrix-vector kernels, so the first draft costs far more than the next ones, and a line
    through the rows alone would underprice a one-draft step and keep verifying drafts that do
    not pay. The first observation sets the scale of a prior: the slopes given (`prior_slopes`:
    per row, per draft, per verify), or else a verify row costing a tenth of the base and no
    fixed cost. `rows_measured` once the rows verified beyond the batch, counted in batches,
    weigh as much as one of the prior's points (both decay alike): until then what a row costs
    is the prior's word, since plain steps all have the same rows. From then on the prior keeps
    a tenth of its weight: its points lie far out on the row axis (1 and 4 x batch + 4 rows),
    and at full weight they would outweigh the measured steps."""

    decay: float = 0.97
    prior_weight: float = 2.0
    prior_slopes: tuple[float, float, float] | None = None
    _xx: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))
    _xy: np.ndarray = field(default_factory=lambda: np.zeros(4))
    _fitted: np.ndarray | None = None
    _stale: bool = False  # observed since the last fit
    _prior_xx: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))  # the prior's
    _prior_xy: np.ndarray = field(default_factory=lambda: np.zeros(4))  # share of _xx, _xy
    _prior_left: float = 0.0  # one prior point's weight, decayed like the observations
    _verified: float = 0.0  # decayed verify rows beyond the batch, in batches

    def observe(self, rows: int, longest: int, seconds: float, verified: float = 0.0) -> None:
        if not self.known:  # the scale: a prior from the first observation
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
        self._stale = True

    @property
    def _coef(self) -> np.ndarray | None:
        """The fit, refitted on first use after an observation (a plan reads it once a step at
        most; an engine that never plans drafts never pays for the least squares)."""
        if self._stale:
            self._fitted = self._fit()
            self._stale = False
        return self._fitted

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
        return self._stale or self._fitted is not None

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
    rows), and a prior that overprices rows is never corrected, since no row is then verified;
    a nearest class at a much smaller batch overprices them the same way. So a class that has
    not measured its verify rows (`rows_measured`) measures them before it plans
    (`SpecController.choose` explores)."""

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
