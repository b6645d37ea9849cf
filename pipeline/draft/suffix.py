"""Suffix drafting (arXiv 2411.04975): what followed the longest match of a request's tail in its
own index or its tenant's shared index of finished outputs (docs/suffix-drafting.md)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pipeline.draft.base import Proposal, Proposer
from pipeline.draft.suffix_index import Match, TokenIndex
from pipeline.params import SamplingParams


@dataclass
class SuffixSettings:
    max_depth: int = 32
    min_score: float = 0.1
    spec_factor: float = 1.0
    global_requests: int = 1000
    global_tokens: int = 262_144
    max_model_len: int = 2048
    share_across_tenants: bool = False
    max_tenants: int = 64


@dataclass
class _Request:
    index: TokenIndex
    num_prompt: int
    tenant: str


_INITIAL_SLOTS = 1024  # a new tenant index's ring; it doubles as it fills


class SuffixProposer(Proposer):
    scores_drafts = True

    def __init__(self, settings: SuffixSettings) -> None:
        self.settings = settings
        self._shared: OrderedDict[str, TokenIndex] = OrderedDict()  # LRU first
        self._seqs: dict[str, _Request] = {}

    def shared_index(self, tenant: str = "") -> TokenIndex:
        key = "" if self.settings.share_across_tenants else tenant
        index = self._shared.get(key)
        if index is None:
            s = self.settings
            index = self._shared[key] = TokenIndex(s.global_tokens, s.max_depth,
                                                   max_runs=s.global_requests,
                                                   initial=_INITIAL_SLOTS)
        self._shared.move_to_end(key)
        return index

    @property
    def global_index(self) -> TokenIndex:
        return self.shared_index("")

    @property
    def num_tenants(self) -> int:
        return len(self._shared)

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            tenant: str = "") -> None:
        # sized for the whole sequence, so it never evicts
        size = min(len(prompt_ids) + params.max_new_tokens, self.settings.max_model_len) + 1
        index = TokenIndex(size, self.settings.max_depth)
        index.extend(prompt_ids)
        self._seqs[rid] = _Request(index, len(prompt_ids), tenant)

    def propose(self, rids: list[str], ks: list[int]) -> Proposal:
        matches = [self._draft(self._seqs[rid], k) if k > 0 else Match()
                   for rid, k in zip(rids, ks)]
        return Proposal(tokens=[m.tokens for m in matches],
                        confidence=[m.confidence for m in matches])

    def commit(self, rid: str, tokens: list[int]) -> None:
        self._seqs[rid].index.extend(tokens)

    def finish(self, rid: str, tokens: list[int]) -> None:
        req = self._seqs.get(rid)
        if req is not None and tokens:
            req.index.extend(tokens[: req.index.capacity - req.index.end])
        self.remove(rid)

    def requests(self) -> list[str]:
        return list(self._seqs)

    def remove(self, rid: str) -> None:
        req = self._seqs.pop(rid, None)
        if req is None or req.index.end == req.num_prompt:
            return
        start = max(0, req.num_prompt - self.settings.max_depth)
        shared = self.shared_index(req.tenant)
        shared.extend(req.index.tokens(start, req.index.end))
        shared.end_run()
        self._evict()

    def _evict(self) -> None:
        s = self.settings
        while len(self._shared) > 1 and (
                len(self._shared) > s.max_tenants
                or sum(len(ix) for ix in self._shared.values()) > s.global_tokens):
            self._shared.popitem(last=False)

    def _draft(self, req: _Request, k: int) -> Match:
        s = self.settings
        own = req.index
        context = own.tokens(own.end - s.max_depth, own.end)
        mine = own.match(context, k, s.min_score, s.spec_factor, exclude_last=True)
        key = "" if s.share_across_tenants else req.tenant
        index = self._shared.get(key)
        if index is None:
            return mine
        self._shared.move_to_end(key)
        shared = index.match(context, k, s.min_score, s.spec_factor)
        return shared if shared.score > mine.score else mine
