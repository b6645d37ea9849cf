"""Offline acceptance: replay the target's greedy generations as speculative decoding would run
them. From the prompt's end, each step proposes k drafts, keeps those equal to the target's next
tokens, and moves on by the kept drafts plus the target's own token. The EAGLE-3 drafter gets,
each step, the aux states of the positions the target just kept, as the verifier would send."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.draft.eagle3 import Eagle3Drafter, Eagle3Head, HeadStep
from pipeline.draft.ngram_lookup import propose_ngram
from scripts.eagle3_train.data import Record


@dataclass
class Acceptance:
    k: int
    steps: int
    tokens: int                 # tokens produced (kept drafts + the target's own)
    by_position: list[float]    # share of steps whose draft j was kept (steps with j left)

    @property
    def length(self) -> float:
        """Tokens per target step (kept drafts + 1)."""
        return self.tokens / max(1, self.steps)


def replay(records: list[Record], k: int,
           propose: Callable[[list[int], list[int], list[int]], list[list[int]]]
           ) -> Acceptance:
    """`propose(active, lengths, previous)`: drafts for records `active`, whose target KV
    holds `lengths[i]` positions (newest token tokens[length]) after holding `previous[i]`."""
    n = [r.prompt_len for r in records]
    prev = [0] * len(records)
    kept = np.zeros(k)
    chances = np.zeros(k)
    steps = tokens = 0
    active = [i for i, r in enumerate(records) if n[i] + 1 < len(r.tokens)]
    while active:
        drafts = propose(active, [n[i] for i in active], [prev[i] for i in active])
        for i, d in zip(active, drafts):
            left = len(records[i].tokens) - n[i] - 1   # tokens after the newest
            truth = records[i].tokens[n[i] + 1:n[i] + 1 + k].tolist()
            a = 0
            while a < len(truth) and a < len(d) and d[a] == truth[a]:
                a += 1
            chances[:len(truth)] += 1
            kept[:a] += 1
            steps += 1
            made = min(a + 1, left)                     # the kept drafts + the target's own
            tokens += made
            prev[i], n[i] = n[i], n[i] + made
        active = [i for i in active if n[i] + 1 < len(records[i].tokens)]
    return Acceptance(k, steps, tokens, [round(float(x), 3) for x in kept / np.maximum(chances, 1)])


def eagle_acceptance(head: Eagle3Head, records: list[Record], k: int) -> Acceptance:
    drafter = Eagle3Drafter(head)
    for i in range(len(records)):
        drafter.add(str(i))

    def propose(active: list[int], lengths: list[int], previous: list[int]) -> list[list[int]]:
        steps = [HeadStep(p, records[i].aux[p:n].float(), records[i].tokens[p + 1:n + 1].tolist())
                 for i, n, p in zip(active, lengths, previous)]
        return drafter.propose([str(i) for i in active], steps, [k] * len(active)).tokens
    return replay(records, k, propose)


def ngram_acceptance(records: list[Record], k: int, min_n: int = 3,
                     max_n: int = 4) -> Acceptance:
    """The embedded default's drafter (configs/smollm2-cpu.yaml: n-gram 3-4)."""
    def propose(active: list[int], lengths: list[int], previous: list[int]) -> list[list[int]]:
        return [[int(t) for t in propose_ngram(records[i].tokens[:n + 1].numpy(), k,
                                               min_n, max_n)[:k]]
                for i, n in zip(active, lengths)]
    return replay(records, k, propose)
