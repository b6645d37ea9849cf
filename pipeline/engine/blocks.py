"""The scheduler's count of KV blocks: per running request, the tokens its stages may hold after
the step planned for it (`reserved`), so planned steps never need more than the pool. Shared
prefix-cache blocks count once per user: an upper bound."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.engine.request import EngineRequest


@dataclass
class BlockBudget:
    num_blocks: int | None  # None: slots are the only limit
    block_size: int
    max_model_len: int
    num_speculative_tokens: int

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def used(self, running: Iterable[EngineRequest]) -> int:
        return sum(self.blocks(r.reserved) for r in running)

    def need(self, running: Iterable[EngineRequest], caps: dict[str, int]) -> int:
        """After this step's forward: verifies grow to kv_len + 1 + cap, the rest keep theirs."""
        return sum(self.blocks(r.kv_len + 1 + caps[r.rid] if r.rid in caps else r.reserved)
                   for r in running)

    def free(self, running: Iterable[EngineRequest], caps: dict[str, int]) -> int | None:
        if self.num_blocks is None:
            return None
        return self.num_blocks - self.need(running, caps)

    def admission(self, req: EngineRequest) -> int:
        """Its prefill and first verify (so it is not preempted at once), capped at one
        max_model_len request, which the pool always holds."""
        return self.blocks(min(len(req.prompt_ids) + len(req.output_ids) + 1
                               + self.num_speculative_tokens, self.max_model_len))

    def victims(self, running: dict[str, EngineRequest],
                caps: dict[str, int]) -> list[EngineRequest]:
        """The newest verifying requests to preempt, newest first, until the rest fit. A lone
        request always fits, and the non-verifying ones fit in what they held last step."""
        if self.num_blocks is None:
            return []
        need = self.need(running.values(), caps)
        candidates = sorted((running[rid] for rid in caps), key=lambda r: r.seq)
        out = []
        while candidates and need > self.num_blocks:
            req = candidates.pop()
            need -= self.blocks(req.kv_len + 1 + caps[req.rid])
            out.append(req)
        return out
