"""Tensor-parallel ranks must hold the same KV blocks: each rank allocates deterministically but
alone, so rank 0's outcome carries a digest of its block decisions, every other rank reports its
own (RankReport), and a mismatch fails the step before its tokens are output."""

from __future__ import annotations

from pipeline.errors import KVDivergenceError
from pipeline.protocol import RankReport, StepOutcome


def check_rank_reports(outcome: StepOutcome, reports: list[RankReport]) -> None:
    bad = [r for r in reports if r.step != outcome.step or r.kv_digest != outcome.kv_digest]
    if bad:
        ranks = ", ".join(f"rank {r.rank} (step {r.step}, {r.kv_digest.hex()})" for r in bad)
        raise KVDivergenceError(
            f"step {outcome.step}: tensor-parallel ranks hold different KV blocks: rank 0 "
            f"{outcome.kv_digest.hex()} vs {ranks}")
