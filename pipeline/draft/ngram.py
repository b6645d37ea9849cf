"""Prompt lookup: draft what followed the latest earlier match of the sequence's tail."""

from __future__ import annotations

import numpy as np

from pipeline.draft.base import Proposal, Proposer
from pipeline.draft.ngram_lookup import propose_ngram
from pipeline.params import SamplingParams


class NgramProposer(Proposer):
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._seqs: dict[str, _TokenBuffer] = {}

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            tenant: str = "") -> None:
        self._seqs[rid] = _TokenBuffer(prompt_ids)

    def propose(self, rids: list[str], ks: list[int]) -> Proposal:
        tokens = []
        for rid, k in zip(rids, ks):
            if k <= 0:
                tokens.append([])
                continue
            drafts = propose_ngram(self._seqs[rid].view(), k, self.min_n, self.max_n)
            tokens.append([int(t) for t in drafts[:k]])
        return Proposal(tokens=tokens)

    def commit(self, rid: str, tokens: list[int]) -> None:
        self._seqs[rid].extend(tokens)

    def requests(self) -> list[str]:
        return list(self._seqs)

    def remove(self, rid: str) -> None:
        self._seqs.pop(rid, None)


class _TokenBuffer:
    # a growable array, so a lookup needs no list -> array copy
    def __init__(self, tokens: list[int]) -> None:
        self._buf = np.zeros(max(64, 2 * len(tokens)), dtype=np.int64)
        self._len = 0
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        need = self._len + len(tokens)
        if need > len(self._buf):
            self._buf = np.concatenate([self._buf, np.zeros(need, dtype=np.int64)])
        self._buf[self._len:need] = tokens
        self._len = need

    def view(self) -> np.ndarray:
        return self._buf[: self._len]
