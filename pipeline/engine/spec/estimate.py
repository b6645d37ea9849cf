"""The per-position acceptance estimate: how likely a draft at position i is to be accepted.

For draft position i the estimate is p[i] = P(position i accepted | position i-1 accepted),
learned only from positions the verifier actually reached: a draft rejected at position j says
nothing about the positions after j. Conditional probabilities make the chain rule exact, so the
expected gain of drafting m tokens is a product of them (`pipeline.engine.spec.plan.gains`).

A request's own record is blended with a pooled one, Beta-style: the pool counts as
`prior_weight` observations, so a new request starts from what recent requests saw and its own
evidence takes over as it accumulates. The same record also keeps a proposer's calibration
(accepted drafts / the confidence it gave them) for proposers that score their drafts.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    def empty(cls, positions: int) -> Acceptance:
        return cls([0.0] * positions, [0] * positions)

    def update(self, drafted: int, accepted: int, alpha: float) -> None:
        """Positions 0..accepted were tried (0..accepted-1 accepted, `accepted` rejected when
        it was drafted); later positions were never reached and say nothing."""
        for i in range(min(drafted, accepted + 1)):
            self.seen[i] += 1
            weight = max(alpha, 1.0 / self.seen[i])
            self.mean[i] += weight * ((1.0 if i < accepted else 0.0) - self.mean[i])

    def fade(self, factor: float) -> None:
        """Older observations count less in `estimate` (the pools, once per step that verified a
        draft): a position nobody drafted lately falls back towards its carried prior. Deep
        positions are reached mostly on copied text; without a fade the ~1.0 they learned there
        would outlive the copies and have later chat requests draft long runs that are rarely
        kept."""
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
