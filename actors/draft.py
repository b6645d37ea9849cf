"""DraftWorker: holds the engine's Proposer; one `propose` call per step."""

from __future__ import annotations

from pipeline.config import EngineConfig
from pipeline.draft.base import Proposal
from pipeline.draft.step import build_proposer, draft_step
from pipeline.engine.step_plan import StepPlan
from pipeline.grammar.tracker import GrammarTracker
from pipeline.models.runners import load_engine_tokenizer


class DraftWorker:
    def __init__(self, config: EngineConfig) -> None:
        _set_threads(config)
        self.proposer = build_proposer(config)
        self.grammars = GrammarTracker(lambda: load_engine_tokenizer(config))

    def propose(self, plan: StepPlan) -> Proposal:
        return draft_step(self.proposer, plan, self.grammars)

    def ping(self) -> bool:
        return True


def _set_threads(config: EngineConfig) -> None:
    if config.torch_threads is not None:
        import torch

        torch.set_num_threads(config.torch_threads)
