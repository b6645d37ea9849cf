"""Hang detection tied to observed step times.

A step is declared stalled after

    bound = clamp(multiple * p99(recent seconds per token) * step tokens, floor, ceiling)

seconds. Time is scaled by the step's tokens (prompt tokens of its prefills, k + 1 per verify)
so that a long prefill after many short decode steps is not mistaken for a hang; the floor keeps
scheduling noise on a loaded machine from failing the engine, and the ceiling
(`step_timeout_s`) is the bound before enough steps were timed (model warm-up, first prefill).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pipeline.protocol import StepPlan

WINDOW = 256  # recent steps the p99 is taken over
MIN_SAMPLES = 16  # steps timed before the bound adapts


def plan_tokens(plan: StepPlan) -> int:
    """The tokens a step computes: its prefills' prompts, k + 1 per verified request."""
    return sum(len(n.prompt_ids) for n in plan.new) + sum(k + 1 for k in plan.draft_bounds)


class StallDetector:
    def __init__(self, floor_s: float, multiple: float, ceiling_s: float) -> None:
        self.floor_s = min(floor_s, ceiling_s)  # the ceiling caps everything
        self.multiple = multiple
        self.ceiling_s = ceiling_s
        self._per_token: deque[float] = deque(maxlen=WINDOW)
        self._p99: float | None = None

    def record(self, seconds: float, tokens: int) -> None:
        """A step of `tokens` tokens took `seconds` (draft + verify)."""
        self._per_token.append(seconds / max(tokens, 1))
        self._p99 = None

    @property
    def p99_per_token_s(self) -> float | None:
        if len(self._per_token) < MIN_SAMPLES:
            return None
        if self._p99 is None:
            self._p99 = float(np.percentile(np.fromiter(self._per_token, float), 99))
        return self._p99

    def bound(self, tokens: int) -> float:
        """Seconds after which a step of `tokens` tokens counts as stalled."""
        p99 = self.p99_per_token_s
        if p99 is None:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.multiple * p99 * max(tokens, 1)))
