"""The scheduler's count of KV blocks: per running request, what its stages may hold after its
planned step (`reserved`; shared prefix blocks once per user), so plans never overfill the pool."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.engine.request import EngineRequest


@dataclass
class BlockBudget:
    num_blocks: int | None
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
        # its prefill and first verify, so it is not preempted at once
        return self.blocks(min(len(req.prompt_ids) + len(req.output_ids) + 1
                               + self.num_speculative_tokens, self.max_model_len))

    def victims(self, running: dict[str, EngineRequest],
                caps: dict[str, int]) -> list[EngineRequest]:
        # the newest verifying requests, until the rest fit (a lone one always does)
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
