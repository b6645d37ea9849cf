"""Tensor-parallel ranks hold the same KV blocks: the check the engine runs after every step.

Each rank keeps its own block manager and applies the plan's calls in the same order; the
allocation is deterministic, so equal calls give equal block ids (pipeline.models.block_manager).
Nothing exchanges the block decisions themselves, so this makes a divergence impossible to miss:
rank 0's outcome carries a digest of its block decisions after the step, every other
rank reports its own (RankReport), and a mismatch fails the step before its tokens are output.
Before a forward that prefills, the ranks also compare digests among themselves
(pipeline.models.tp.check_ranks_agree), since prefix-cache hits set the forward's shapes.
"""

from __future__ import annotations

from pipeline.errors import KVDivergenceError
from pipeline.protocol import RankReport, StepOutcome


def check_rank_reports(outcome: StepOutcome, reports: list[RankReport]) -> None:
    """KVDivergenceError naming the step and the ranks whose digest differs from rank 0's."""
    bad = [r for r in reports if r.step != outcome.step or r.kv_digest != outcome.kv_digest]
    if bad:
        ranks = ", ".join(f"rank {r.rank} (step {r.step}, {r.kv_digest.hex()})" for r in bad)
        raise KVDivergenceError(
            f"step {outcome.step}: tensor-parallel ranks hold different KV blocks: rank 0 "
            f"{outcome.kv_digest.hex()} vs {ranks}")
