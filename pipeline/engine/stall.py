"""A step is stalled after clamp(multiple * p99(recent seconds per token) * its tokens, floor,
ceiling) seconds; fresh stages' first COLD_STEPS steps get the engine's first steps' rate."""

from __future__ import annotations

from collections import deque

import numpy as np

from pipeline.protocol import StepPlan

WINDOW = 256
MIN_SAMPLES = 16
COLD_STEPS = 3
REFRESH = 16  # steps between recomputing the p99 (sooner when a step was slower than it)


def plan_tokens(plan: StepPlan) -> int:
    return plan.num_tokens


class StallDetector:
    def __init__(self, floor_s: float, multiple: float, ceiling_s: float) -> None:
        self.floor_s = min(floor_s, ceiling_s)
        self.multiple = multiple
        self.ceiling_s = ceiling_s
        self._per_token: deque[float] = deque(maxlen=WINDOW)
        self._p99: float | None = None
        self._since_p99 = 0
        self._steps = 0
        self._cold: list[float] = []
        self._carried = False

    def record(self, seconds: float, tokens: int) -> None:
        per_token = seconds / max(tokens, 1)
        self._per_token.append(per_token)
        self._since_p99 += 1
        # a percentile costs more than a null step; a stale p99 only errs high
        if self._p99 is None or per_token > self._p99 or self._since_p99 >= REFRESH:
            self._p99 = None
        self._steps += 1
        if len(self._cold) < COLD_STEPS:
            self._cold.append(per_token)

    def carry_over(self) -> StallDetector:
        new = StallDetector(self.floor_s, self.multiple, self.ceiling_s)
        new._per_token.extend(self._per_token)
        new._cold = list(self._cold)
        new._carried = True
        return new

    @property
    def p99_per_token_s(self) -> float | None:
        if len(self._per_token) < MIN_SAMPLES:
            return None
        if self._p99 is None:
            self._p99 = float(np.percentile(np.fromiter(self._per_token, float), 99))
            self._since_p99 = 0
        return self._p99

    def bound(self, tokens: int) -> float:
        p99 = self.p99_per_token_s
        if p99 is None:
            return self.ceiling_s
        if self._carried and self._steps < COLD_STEPS and self._cold:
            p99 = max(p99, max(self._cold))
        return min(self.ceiling_s, max(self.floor_s, self.multiple * p99 * max(tokens, 1)))
