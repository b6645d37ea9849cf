"""The one drafting interface the engine talks to, whatever produces the drafts.

Invariants every proposer keeps:
- a request's sequence is its prompt plus every token `commit` gave it, in order;
- `propose` never changes that sequence (drafts are tentative); `commit` makes the accepted
  tokens part of it and discards whatever was drafted beyond them (the rollback);
- `propose(rids, ks)` returns at most `ks[i]` tokens for request i (0 is allowed: no drafts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pipeline.params import SamplingParams
from pipeline.protocol import Proposal  # the message a proposer fills (declared with the others)


class Proposer(ABC):
    # True when `propose` fills Proposal.confidence: the draft stage then drafts up to the
    # plan's caps and keeps the drafts scored at least the plan's min_gains.
    scores_drafts: bool = False

    @abstractmethod
    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            tenant: str = "") -> None:
        """Start tracking a request (its sequence is the prompt). `tenant` (NewRequest.tenant):
        a proposer that learns across requests keeps what it learns per tenant."""

    @abstractmethod
    def propose(self, rids: list[str], ks: list[int]) -> Proposal:
        """Up to ks[i] draft tokens continuing request i's sequence."""

    @abstractmethod
    def commit(self, rid: str, tokens: list[int]) -> None:
        """Append a step's accepted tokens (accepted drafts, then the target's token)."""

    @abstractmethod
    def remove(self, rid: str) -> None:
        """Forget a request and free what it held; unknown rids are ignored."""

    def prefill(self, rids: list[str], counts: list[int]) -> None:
        """The target computed up to `counts[i]` more prompt tokens of request i this step (a
        prefill chunk). A proposer with a KV cache of its own fills it as far (so it is never
        asked for a whole long prompt in one step); the others need nothing."""

    def finish(self, rid: str, tokens: list[int]) -> None:
        """A request ended; `tokens` its last step's, never committed. Only a proposer that
        learns from finished outputs needs them."""
        self.remove(rid)

    def requests(self) -> list[str]:
        """The requests being tracked ([] for a proposer that keeps nothing per request)."""
        return []

    def reset(self) -> None:
        """Forget every request: the engine failed them all and their ids may come back. What
        was learnt across requests (a shared index, a prefix cache) may stay."""
        for rid in self.requests():
            self.remove(rid)
