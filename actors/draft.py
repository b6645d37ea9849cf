"""DraftWorker: holds the engine's Proposer; one `propose` call per step."""

from __future__ import annotations

from pipeline.config import EngineConfig
from pipeline.draft.base import Proposal
from pipeline.draft.step import build_proposer, draft_step
from pipeline.engine.step_plan import StepPlan
from pipeline.grammar.memory import set_memory_budget
from pipeline.grammar.tracker import GrammarTracker
from pipeline.models.runners import load_engine_tokenizer, set_torch_threads


class DraftWorker:
    def __init__(self, config: EngineConfig) -> None:
        set_torch_threads(config)
        set_memory_budget(config.grammar_memory_mb << 20)
        self.proposer = build_proposer(config)
        self.grammars = GrammarTracker(lambda: load_engine_tokenizer(config))

    def propose(self, plan: StepPlan) -> Proposal:
        return draft_step(self.proposer, plan, self.grammars)

    def ping(self) -> bool:
        return True
