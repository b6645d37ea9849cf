"""Hang detection tied to observed step times.

A step is declared stalled after

    bound = clamp(multiple * p99(recent seconds per token) * step tokens, floor, ceiling)

seconds. Time is scaled by the step's tokens (prompt tokens of its prefill chunks, k + 1 per verify)
so that a long prefill after many short decode steps is not mistaken for a hang; the floor keeps
scheduling noise on a loaded machine from failing the engine, and the ceiling
(`step_timeout_s`) is the bound before enough steps were timed (model warm-up, first prefill).

After a rebuild (new stage actors, same model and hardware) the timings carry over
(`carry_over`): the bound is the adapted one from the first step, not the ceiling for another 16
steps. Fresh stages' first COLD_STEPS steps (kernel loading, first allocations) get at least the
time per token the engine's very first steps took, scaled like any other step: that is what a
cold stage was seen to need, and on a CPU replica it is far under the ceiling.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pipeline.protocol import StepPlan

WINDOW = 256  # recent steps the p99 is taken over
MIN_SAMPLES = 16  # steps timed before the bound adapts
COLD_STEPS = 3  # a fresh stage's first steps, timed apart as its warm-up
REFRESH = 16  # steps between recomputing the p99 (sooner when a step was slower than it)


def plan_tokens(plan: StepPlan) -> int:
    """The tokens a step computes: its prefills' prompt chunks (whole prompts when unchunked),
    k + 1 per verified request (StepPlan.num_tokens)."""
    return plan.num_tokens


class StallDetector:
    def __init__(self, floor_s: float, multiple: float, ceiling_s: float) -> None:
        self.floor_s = min(floor_s, ceiling_s)  # the ceiling caps everything
        self.multiple = multiple
        self.ceiling_s = ceiling_s
        self._per_token: deque[float] = deque(maxlen=WINDOW)
        self._p99: float | None = None
        self._since_p99 = 0  # steps recorded since the p99 was computed
        self._steps = 0  # steps timed on the current stages
        self._cold: list[float] = []  # seconds per token of the engine's first COLD_STEPS steps
        self._carried = False  # built by carry_over: the stages are fresh, the timings are not

    def record(self, seconds: float, tokens: int) -> None:
        """A step of `tokens` tokens took `seconds` (draft + verify)."""
        per_token = seconds / max(tokens, 1)
        self._per_token.append(per_token)
        self._since_p99 += 1
        # A percentile each step costs more than a null step; a stale p99 only errs high (a
        # faster step), and a slower step than it refreshes it at once.
        if self._p99 is None or per_token > self._p99 or self._since_p99 >= REFRESH:
            self._p99 = None
        self._steps += 1
        if len(self._cold) < COLD_STEPS:
            self._cold.append(per_token)

    def carry_over(self) -> StallDetector:
        """The detector for rebuilt stages: these timings, the fresh stages' warm-up allowance."""
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
        """Seconds after which a step of `tokens` tokens counts as stalled."""
        p99 = self.p99_per_token_s
        if p99 is None:
            return self.ceiling_s
        if self._carried and self._steps < COLD_STEPS and self._cold:  # fresh stages warming up
            p99 = max(p99, max(self._cold))
        return min(self.ceiling_s, max(self.floor_s, self.multiple * p99 * max(tokens, 1)))
