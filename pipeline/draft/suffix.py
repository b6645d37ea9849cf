"""Suffix drafting (SuffixDecoding, arXiv 2411.04975): match the longest suffix of a request's
sequence in two indexes and draft what followed it, for as long as it keeps following it often.

- the request's own index over its prompt + output (copies within the request);
- its tenant's shared index over the outputs of that tenant's last `global_requests` finished
  requests, at most `global_tokens` tokens (traffic that repeats across requests: the same file
  rewritten, the same tool-call JSON). A finished request enters it when the plan releases the
  request, from the tokens this proposer already holds, so no message carries extra data. Each
  output is stored after the last `max_depth` tokens of its prompt, so the first output tokens
  can be matched too.

Tenants (NewRequest.tenant: a hash of the API key and `user`): by default each tenant has its
own shared index, so what one tenant sent never shapes another's drafts, and so never its
`draft_tokens` or acceptance (a shared index let a tenant read another's prompts through them:
docs/suffix-drafting.md). `share_across_tenants` pools every tenant into one index. The tenant
indexes together hold at most `global_tokens` tokens and `max_tenants` indexes: past either, the
least recently used tenant's index is dropped whole (what crosses tenants is that pressure,
never content). An index grows with what it holds, so an idle tenant costs little memory.

Of the two candidate drafts the one with the higher expected accepted length (sum of its
per-position confidences) is proposed; the confidences go out with it (`Proposal.confidence`)
for a controller that decides how many drafts to verify.

Not ArcticInference's suffix tree (PyPI arctic-inference 0.3.0): it ships only an sdist whose
build requires torch>=2.10 (an isolated build pulls a CUDA torch; our GPU set pins torch 2.4.0)
and imports torch in setup.py; its C++ tree alone does build with nanobind. Hence numpy here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pipeline.draft.base import Proposal, Proposer
from pipeline.draft.suffix_index import Match, TokenIndex
from pipeline.params import SamplingParams


@dataclass
class SuffixSettings:
    max_depth: int = 32  # longest context suffix matched
    min_score: float = 0.1  # stop drafting where confidence falls below this
    spec_factor: float = 1.0  # at most spec_factor * matched length drafts
    global_requests: int = 1000  # finished outputs kept in the global index
    global_tokens: int = 262_144  # and at most this many tokens
    max_model_len: int = 2048  # caps a request's own index
    share_across_tenants: bool = False  # one shared index for every tenant (see the docstring)
    max_tenants: int = 64  # tenant indexes kept at once


@dataclass
class _Request:
    index: TokenIndex  # prompt + committed output
    num_prompt: int
    tenant: str  # its partition of the shared indexes


_INITIAL_SLOTS = 1024  # a new tenant index's ring (it doubles as it fills)


class SuffixProposer(Proposer):
    scores_drafts = True

    def __init__(self, settings: SuffixSettings) -> None:
        self.settings = settings
        # tenant -> its shared index, least recently used first
        self._shared: OrderedDict[str, TokenIndex] = OrderedDict()
        self._seqs: dict[str, _Request] = {}

    def shared_index(self, tenant: str = "") -> TokenIndex:
        """The shared index `tenant`'s requests draft from and feed (made on first use)."""
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
        """The anonymous tenant's shared index (every tenant's, when shared)."""
        return self.shared_index("")

    @property
    def num_tenants(self) -> int:
        return len(self._shared)

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            tenant: str = "") -> None:
        # sized for the whole sequence, so it never evicts (a longer one would only forget)
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
        if req is not None and tokens:  # the global index learns the whole output
            req.index.extend(tokens[: req.index.capacity - req.index.end])
        self.remove(rid)

    def requests(self) -> list[str]:
        return list(self._seqs)

    def remove(self, rid: str) -> None:
        req = self._seqs.pop(rid, None)
        if req is None or req.index.end == req.num_prompt:  # nothing generated: nothing to learn
            return
        start = max(0, req.num_prompt - self.settings.max_depth)
        shared = self.shared_index(req.tenant)
        shared.extend(req.index.tokens(start, req.index.end))
        shared.end_run()
        self._evict()

    def _evict(self) -> None:
        """Drop the least recently used tenant indexes past the budget (the newest stays)."""
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
        if index is None:  # nothing of this tenant's finished yet
            return mine
        self._shared.move_to_end(key)
        shared = index.match(context, k, s.min_score, s.spec_factor)
        return shared if shared.score > mine.score else mine
