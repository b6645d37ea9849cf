"""Per draft position, P(accepted | the position before it accepted), learned only from positions
the verifier reached, so the expected gain of m drafts is a product (`plan.gains`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Acceptance:
    # the plain mean of the first 1/alpha observations, an EMA after: no start value to unlearn
    mean: list[float]
    seen: list[float]
    idle: int = 0  # steps in a row without a verified draft
    probe_wait: int = 0
    run: bool = False  # the last verified draft was accepted whole
    accepted: float = 0.0
    expected: float = 0.0  # with `accepted`: decayed sums over scored drafts

    @classmethod
    def empty(cls, positions: int) -> Acceptance:
        return cls([0.0] * positions, [0] * positions)

    def update(self, drafted: int, accepted: int, alpha: float) -> None:
        for i in range(min(drafted, accepted + 1)):
            self.seen[i] += 1
            weight = max(alpha, 1.0 / self.seen[i])
            self.mean[i] += weight * ((1.0 if i < accepted else 0.0) - self.mean[i])

    def fade(self, factor: float) -> None:
        # deep positions learn ~1.0 on copied text; unfaded, it would outlive the copies
        self.seen = [n * factor for n in self.seen]

    def calibrate(self, expected: float, accepted: int, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.expected = decay * self.expected + expected

    def calibration(self, prior: float, prior_weight: float) -> float:
        return (self.accepted + prior_weight * prior) / (self.expected + prior_weight)

    def estimate(self, prior: list[float], prior_weight: float,
                 carry: bool = False) -> list[float]:
        # carry: a position's prior is at least the estimate before it (copied runs)
        out, before = [], 0.0
        for prior_i, mean, n in zip(prior, self.mean, self.seen):
            p = max(prior_i, before) if carry else prior_i
            before = (prior_weight * p + n * mean) / (prior_weight + n)
            out.append(before)
        return out
