"""Timers around the in-process engine's stages and model forwards (also used by
scripts/bench_step_overhead.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pipeline.draft.step import draft_step
from pipeline.engine.local import LocalStages


@dataclass
class StageTimes:
    draft: float = 0.0  # draft_step: proposer bookkeeping + lookup or draft-model forwards
    draft_forward: float = 0.0  # draft-model forwards only
    verify: float = 0.0  # Verifier.step: target forward, acceptance, message encode
    verify_forward: float = 0.0  # target-model forwards only
    output: float = 0.0  # OutputProcessor.process


class Clock:
    """The StageTimes that timed wrappers currently add to (one per benchmark run)."""

    def __init__(self) -> None:
        self.times = StageTimes()

    def wrap_forward(self, runner: Any, attr: str) -> None:
        inner = runner.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                setattr(self.times, attr, getattr(self.times, attr) + time.perf_counter() - t0)

        runner.forward = forward


def timed_stages(clock: Clock) -> Any:
    """A LocalStages subclass adding each stage's time to `clock` (for build_local_engine)."""
    class TimedStages(LocalStages):
        def step(self, plan: Any) -> Any:
            t0 = time.perf_counter()
            proposal = draft_step(self.proposer, plan, self.grammars)
            t1 = time.perf_counter()
            outcome = self.verifier.step(plan, proposal)
            t2 = time.perf_counter()
            clock.times.draft += t1 - t0
            clock.times.verify += t2 - t1
            return outcome

        async def process(self, payload: bytes) -> Any:
            t0 = time.perf_counter()
            out = self.output.process(payload)
            clock.times.output += time.perf_counter() - t0
            return out

    return TimedStages
