"""The draft side of a step: apply the plan to a Proposer, then propose."""

from __future__ import annotations

import time

from pipeline.config import EngineConfig
from pipeline.draft.base import Proposal, Proposer
from pipeline.draft.model import DraftModelProposer
from pipeline.draft.ngram import NgramProposer
from pipeline.draft.none import NoProposer
from pipeline.draft.suffix import SuffixProposer, SuffixSettings
from pipeline.grammar.tracker import GrammarTracker
from pipeline.models.runners import build_runner
from pipeline.protocol import StepPlan


def draft_step(proposer: Proposer, plan: StepPlan,
               grammars: GrammarTracker | None = None) -> Proposal:
    """Apply `plan` to the proposer, then draft; with `grammars`, drafts end before the first
    token a request's grammar rejects."""
    if grammars is not None:
        grammars.apply(plan)
    for rid in plan.release:
        proposer.finish(rid, plan.finals.get(rid, []))
    if plan.hidden is not None:  # before `new`: a request re-added here had its states freed
        proposer.hidden_states(plan.hidden)
    for new in plan.new:
        proposer.add(new.rid, new.prompt_ids, new.params, new.tenant)
    for rid, tokens in plan.commits.items():
        proposer.commit(rid, tokens)
    chunks = [len(n.prompt_ids) if n.chunk is None else n.chunk for n in plan.new]
    if chunks or plan.prefills:
        proposer.prefill([n.rid for n in plan.new] + plan.prefills,
                         chunks + [e - s for s, e in zip(plan.prefill_starts, plan.prefill_ends)])
    start = time.perf_counter()
    if proposer.scores_drafts and plan.min_gains:
        # a floor above 1 no confidence can reach: no lookup
        asks = [0 if floor > 1.0 else b for b, floor in zip(plan.draft_bounds, plan.min_gains)]
        proposal = proposer.propose(plan.decode, asks)
        _cut(proposal, keep_confident(proposal, plan.min_gains))
    else:
        proposal = proposer.propose(plan.decode, plan.ks)
    if grammars:
        _cut(proposal, grammars.cut(plan.decode, proposal.tokens))
    proposal.seconds = time.perf_counter() - start
    return proposal


def reset_draft(proposer: Proposer, grammars: GrammarTracker | None = None) -> None:
    proposer.reset()
    if grammars is not None:
        grammars.reset()


def keep_confident(proposal: Proposal, min_gains: list[float]) -> list[list[int]]:
    """Each request's drafts while their confidence (never growing) is at least its floor."""
    if proposal.confidence is None:
        return proposal.tokens
    out = []
    for tokens, conf, floor in zip(proposal.tokens, proposal.confidence, min_gains):
        n = 0
        while n < len(tokens) and n < len(conf) and conf[n] >= floor:
            n += 1
        out.append(tokens[:n])
    return out


def _cut(proposal: Proposal, tokens: list[list[int]]) -> None:
    proposal.tokens = tokens
    if proposal.probs is not None:
        proposal.probs = [p if p is None else p[: len(t)] for p, t in zip(proposal.probs, tokens)]
    if proposal.confidence is not None:
        proposal.confidence = [c[: len(t)] for c, t in zip(proposal.confidence, tokens)]


def build_proposer(config: EngineConfig) -> Proposer:
    return _BUILDERS[config.draft](config)


def _ngram(config: EngineConfig) -> Proposer:
    return NgramProposer(config.ngram_min_n, config.ngram_max_n)


def _suffix(config: EngineConfig) -> Proposer:
    return SuffixProposer(SuffixSettings(
        max_depth=config.suffix_max_depth, min_score=config.suffix_min_score,
        spec_factor=config.suffix_spec_factor, global_requests=config.suffix_global_requests,
        global_tokens=config.suffix_global_tokens, max_model_len=config.max_model_len,
        share_across_tenants=config.suffix_share_across_tenants,
        max_tenants=config.suffix_max_tenants))


def _model(config: EngineConfig) -> Proposer:
    return DraftModelProposer(build_runner(config, role="draft"))


def _eagle3(config: EngineConfig) -> Proposer:
    from pipeline.draft.eagle3.proposer import build_eagle3_proposer  # lazy: reads a head

    return build_eagle3_proposer(config)


def _none(config: EngineConfig) -> Proposer:
    return NoProposer()


_BUILDERS = {"ngram": _ngram, "suffix": _suffix, "model": _model, "eagle3": _eagle3,
             "none": _none}
