"""A step's prefill work under its token budget (mini-sglang's PrefillAdder): prefills under
way continue oldest first, admissions take what is left; a prompt that does not fit is cut into
[start, end) chunks, and only the chunk that ends it yields a token."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.engine.request import EngineRequest
from pipeline.protocol import StepPlan


@dataclass
class TokenBudget:
    left: int | None  # None: no budget

    @classmethod
    def after_verifies(cls, budget: int | None, caps: Iterable[int]) -> TokenBudget:
        return cls(None if budget is None else max(0, budget - sum(1 + c for c in caps)))

    @property
    def spent(self) -> bool:
        return self.left == 0

    def take(self, want: int) -> int:
        if self.left is None:
            return want
        n = min(self.left, want)
        self.left -= n
        return n


@dataclass
class Chunk:
    req: EngineRequest
    start: int
    end: int


def continuing_chunks(running: Iterable[EngineRequest], budget: TokenBudget) -> list[Chunk]:
    chunks = []
    for req in sorted((r for r in running if r.prefilling), key=lambda r: r.seq):
        if budget.spent:
            break
        start = req.computed
        chunks.append(Chunk(req, start, start + budget.take(req.prefill_len - start)))
    return chunks


def plan_chunks(plan: StepPlan, chunks: list[Chunk]) -> None:
    for chunk in chunks:
        plan.prefills.append(chunk.req.rid)
        plan.prefill_starts.append(chunk.start)
        plan.prefill_ends.append(chunk.end)
        chunk.req.computed = chunk.end
