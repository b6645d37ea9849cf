"""Suffix drafting (SuffixDecoding, arXiv 2411.04975): match the longest suffix of a request's
sequence in two indexes and draft what followed it, for as long as it keeps following it often.

- the request's own index over its prompt + output (copies within the request);
- one global index over the outputs of the last `global_requests` finished requests, at most
  `global_tokens` tokens (traffic that repeats across requests: the same file rewritten, the same
  tool-call JSON). A finished request enters it when the plan releases the request, from the
  tokens this proposer already holds, so no message carries extra data. Each output is stored
  after the last `max_depth` tokens of its prompt, so the first output tokens can be matched too.

Of the two candidate drafts the one with the higher expected accepted length (sum of its
per-position confidences) is proposed; the confidences go out with it (`Proposal.confidence`)
for a controller that decides how many drafts to verify.

Not ArcticInference's suffix tree (PyPI arctic-inference 0.3.0): it ships only an sdist whose
build requires torch>=2.10 (an isolated build pulls a CUDA torch; our GPU set pins torch 2.4.0)
and imports torch in setup.py; its C++ tree alone does build with nanobind. Hence numpy here.
"""

from __future__ import annotations

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


@dataclass
class _Request:
    index: TokenIndex  # prompt + committed output
    num_prompt: int


class SuffixProposer(Proposer):
    scores_drafts = True

    def __init__(self, settings: SuffixSettings) -> None:
        self.settings = settings
        self.global_index = TokenIndex(settings.global_tokens, settings.max_depth,
                                       max_runs=settings.global_requests)
        self._seqs: dict[str, _Request] = {}

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        # sized for the whole sequence, so it never evicts (a longer one would only forget)
        size = min(len(prompt_ids) + params.max_new_tokens, self.settings.max_model_len) + 1
        index = TokenIndex(size, self.settings.max_depth)
        index.extend(prompt_ids)
        self._seqs[rid] = _Request(index, len(prompt_ids))

    def propose(self, rids: list[str], ks: list[int]) -> Proposal:
        matches = [self._draft(self._seqs[rid].index, k) if k > 0 else Match()
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

    def remove(self, rid: str) -> None:
        req = self._seqs.pop(rid, None)
        if req is None or req.index.end == req.num_prompt:  # nothing generated: nothing to learn
            return
        start = max(0, req.num_prompt - self.settings.max_depth)
        self.global_index.extend(req.index.tokens(start, req.index.end))
        self.global_index.end_run()

    def _draft(self, own: TokenIndex, k: int) -> Match:
        s = self.settings
        context = own.tokens(own.end - s.max_depth, own.end)
        mine = own.match(context, k, s.min_score, s.spec_factor, exclude_last=True)
        shared = self.global_index.match(context, k, s.min_score, s.spec_factor)
        return shared if shared.score > mine.score else mine
