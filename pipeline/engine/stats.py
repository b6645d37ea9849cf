"""The engine's running counters (named like vLLM's spec-decode and prefix-cache metrics), read by
the metrics endpoint and benchmarks. Raw counts: before finish truncation; every decode
request-step is a verify step, a draft one with >= 1 draft token; `k_chosen[k]` counts verify
steps given k drafts, `step_seconds` decode-only steps per upper bound of STEP_BUCKETS."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from pipeline.output.request_state import count_into
from pipeline.protocol import StepOutcome

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class EngineStats:
    steps: int = 0
    verify_steps: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    histogram: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    k_chosen: list[int] = field(default_factory=list)
    step_seconds: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    step_seconds_sum: float = 0.0
    stalls: int = 0
    # in prompt tokens: every first prefill's prompt, and its part served from the cache
    prefix_queries: int = 0
    prefix_hits: int = 0
    hidden_state_bytes: int = 0  # the target's states sent on to an EAGLE-3 draft stage
    steps_ahead: int = 0  # planned and sent before the step before them returned

    def view(self) -> dict[str, Any]:
        return {
            "prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
            "steps": self.steps, "verify_steps": self.verify_steps, "num_drafts": self.drafts,
            "num_draft_tokens": self.draft_tokens, "num_accepted_tokens": self.accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "acceptance_histogram": list(self.histogram), "k_chosen": list(self.k_chosen),
            "step_seconds": {"buckets": list(STEP_BUCKETS), "counts": list(self.step_seconds),
                             "sum": self.step_seconds_sum},
            "stalls": self.stalls, "hidden_state_bytes": self.hidden_state_bytes,
            "steps_ahead": self.steps_ahead,
        }

    def record(self, outcome: StepOutcome, num_prefills: int) -> None:
        """One step, whose first `num_prefills` rows were prefills."""
        self.steps += 1
        if outcome.decode_s is not None:
            self.step_seconds[bisect.bisect_left(STEP_BUCKETS, outcome.decode_s)] += 1
            self.step_seconds_sum += outcome.decode_s
        for tokens, drafted in zip(outcome.tokens[num_prefills:],
                                   outcome.drafted[num_prefills:]):
            accepted = len(tokens) - 1
            self.verify_steps += 1
            count_into(self.histogram, accepted)
            count_into(self.k_chosen, drafted)
            if drafted == 0:
                continue
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            for pos in range(accepted):
                count_into(self.accepted_per_pos, pos)


def scheduler_view(scheduler: Any) -> dict[str, Any]:
    return {
        "num_slots": scheduler.max_running, "free_slots": scheduler.free_slots,
        "kv_blocks": scheduler.num_blocks, "kv_blocks_used": scheduler.blocks_used,
        "preemptions": scheduler.preemptions, "running": len(scheduler.running),
        "waiting": len(scheduler.waiting), "max_waiting": scheduler.max_waiting,
    }
