"""DraftWorker: holds the engine's Proposer; one `propose` call per step (plan bytes in,
proposal bytes out: pipeline.protocol's msgpack, never a pickled object)."""

from __future__ import annotations

from pipeline.config import EngineConfig
from pipeline.draft.step import build_proposer, draft_step, reset_draft
from pipeline.grammar.memory import set_memory_budget
from pipeline.grammar.tracker import GrammarTracker
from pipeline.models.runners import load_engine_tokenizer, set_torch_threads
from pipeline.protocol import decode_plan, encode_proposal


class DraftWorker:
    def __init__(self, config: EngineConfig) -> None:
        set_torch_threads(config)
        set_memory_budget(config.grammar_memory_mb << 20)
        self.proposer = build_proposer(config)
        self.grammars = GrammarTracker(lambda: load_engine_tokenizer(config))

    def propose(self, plan: bytes) -> bytes:
        return encode_proposal(draft_step(self.proposer, decode_plan(plan), self.grammars))

    def reset(self) -> bool:
        """Forget every request (kept across an engine rebuild that failed them)."""
        reset_draft(self.proposer, self.grammars)
        return True

    def ping(self) -> bool:
        return True
