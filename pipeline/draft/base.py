"""The drafting interface. A request's sequence is its prompt plus every token `commit` gave it;
`propose` never changes it and returns at most `ks[i]` tokens for request i; `commit` discards
whatever was drafted beyond the accepted tokens (the rollback)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pipeline.params import SamplingParams
from pipeline.protocol import HiddenStates, Proposal


class Proposer(ABC):
    # True when `propose` fills Proposal.confidence: the draft stage then applies the plan's floors
    scores_drafts: bool = False

    @abstractmethod
    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            tenant: str = "") -> None:
        """Start tracking a request; what is learnt across requests is kept per `tenant`."""

    @abstractmethod
    def propose(self, rids: list[str], ks: list[int]) -> Proposal:
        """Up to ks[i] draft tokens continuing request i's sequence."""

    @abstractmethod
    def commit(self, rid: str, tokens: list[int]) -> None:
        """Append a step's accepted drafts, then the target's token."""

    @abstractmethod
    def remove(self, rid: str) -> None:
        """Forget a request and free what it held; unknown rids are ignored."""

    def hidden_states(self, states: HiddenStates) -> None:
        """The target's aux states at the positions the last step kept (an EAGLE-3 head)."""

    def prefill(self, rids: list[str], counts: list[int]) -> None:
        """The target prefilled counts[i] more prompt tokens of request i (a draft KV follows)."""

    def finish(self, rid: str, tokens: list[int]) -> None:
        # `tokens`: the last step's, never committed (for a proposer that learns from outputs)
        self.remove(rid)

    def requests(self) -> list[str]:
        return []

    def reset(self) -> None:
        # the engine failed every request; what is shared across requests may stay
        for rid in self.requests():
            self.remove(rid)
