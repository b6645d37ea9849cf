"""What a decode step costs, fitted from measured step times per batch class."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class CostModel:
    """Step seconds ~ base + per_row * rows + per_draft * longest + per_verify * (longest > 0)
    (on CPU the first draft leaves the matrix-vector kernels), by decayed least squares."""

    decay: float = 0.97
    prior_weight: float = 2.0
    prior_slopes: tuple[float, float, float] | None = None
    _xx: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))
    _xy: np.ndarray = field(default_factory=lambda: np.zeros(4))
    _fitted: np.ndarray | None = None
    _stale: bool = False
    _prior_xx: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))
    _prior_xy: np.ndarray = field(default_factory=lambda: np.zeros(4))
    _prior_left: float = 0.0
    _verified: float = 0.0

    def observe(self, rows: int, longest: int, seconds: float, verified: float = 0.0) -> None:
        if not self.known:
            if self.prior_slopes is None:
                base = seconds / (1.0 + 0.1 * rows)
                per_row, per_draft, per_verify = 0.1 * base, 0.0, 0.0
            else:
                per_row, per_draft, per_verify = self.prior_slopes
                base = max(seconds - per_row * rows - per_draft * longest
                           - per_verify * (longest > 0), 0.1 * seconds)
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
        if self.rows_measured and not was_measured:  # the prior keeps a tenth of its weight
            self._xx -= 0.9 * self._prior_xx
            self._xy -= 0.9 * self._prior_xy
            self._prior_xx *= 0.1
            self._prior_xy *= 0.1
            self._prior_left *= 0.1
        self._stale = True

    @property
    def _coef(self) -> np.ndarray | None:
        if self._stale:
            self._fitted = self._fit()
            self._stale = False
        return self._fitted

    def _fit(self) -> np.ndarray:
        # a negative slope is left out and the rest refitted: clipping would misprice the others
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
        """(plain step of `batch` rows, per verify row, per draft position, per_verify)."""
        assert self._coef is not None
        c0, c1, c2, c3 = (float(c) for c in self._coef)
        return c0 + c1 * batch, c1, c2, c3


class StepCosts:
    """A CostModel per batch class (1, 2-3, 4-7, ...): the row count picks the matmul kernel."""

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
