"""k = 0: no drafts, so every step is plain target decoding through the same engine path."""

from __future__ import annotations

from pipeline.draft.base import Proposal, Proposer
from pipeline.params import SamplingParams


class NoProposer(Proposer):
    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            tenant: str = "") -> None:
        pass

    def propose(self, rids: list[str], ks: list[int]) -> Proposal:
        return Proposal(tokens=[[] for _ in rids])

    def commit(self, rid: str, tokens: list[int]) -> None:
        pass

    def remove(self, rid: str) -> None:
        pass
