"""Chain EAGLE-3 drafts per request. Head position i pairs the target's aux hidden state at
position i with token i + 1, so a step that kept positions p..p+m-1 (their aux states, and the
token after each, the last being the target's new token) feeds m pairs; the last one's output
gives draft 1, and draft j + 1 takes draft j's token with the head's own pre-norm hidden state.
Only target-fed pairs stay in a request's cache: draft pairs are dropped after `propose`, since
a kept draft comes back next step with the target's hidden state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.draft.eagle3.head import Eagle3Head, HeadKV
from pipeline.protocol import Proposal


@dataclass
class HeadStep:
    """One request's new kept positions: `aux` [m, n_aux * H_target] for positions
    start..start+m-1, `next_tokens[i]` the token after position start + i."""

    start: int
    aux: torch.Tensor
    next_tokens: list[int]


@dataclass
class HeadDrafts:
    """Per request: draft target ids, and the head's probability of each (its confidence; the
    drafts are its argmax, so as a proposal q they are one-hot)."""

    tokens: list[list[int]]
    probs: list[list[float]]

    def to_proposal(self) -> Proposal:
        """Point-mass drafts (probs None); confidence j: the head's chance of drafts 0..j."""
        confidence = [[float(c) for c in torch.tensor(p, dtype=torch.float64).cumprod(0)]
                      for p in self.probs]
        return Proposal(tokens=[list(t) for t in self.tokens], probs=None,
                        confidence=confidence)


class Eagle3Drafter:
    def __init__(self, head: Eagle3Head) -> None:
        self.head = head
        self._kv: dict[str, HeadKV] = {}

    def add(self, rid: str) -> None:
        if rid in self._kv:
            raise ValueError(f"eagle3: request {rid!r} already added")
        self._kv[rid] = self.head.new_cache()

    def remove(self, rid: str) -> None:
        self._kv.pop(rid, None)

    def length(self, rid: str) -> int:
        """Target positions whose pairs the head holds."""
        return self._kv[rid].length

    def truncate(self, rid: str, length: int) -> None:
        self._kv[rid].truncate(length)

    def requests(self) -> list[str]:
        return list(self._kv)

    @torch.no_grad()
    def propose(self, rids: list[str], steps: list[HeadStep], ks: list[int]) -> HeadDrafts:
        """A step starting before what the head holds rolls it back to `start` first; one past
        it is a gap (hidden states never sent) and raises."""
        if not len(rids) == len(steps) == len(ks):
            raise ValueError(f"eagle3: {len(rids)} rids, {len(steps)} steps, {len(ks)} ks")
        caches = [self._kv[rid] for rid in rids]
        for rid, cache, step, k in zip(rids, caches, steps, ks):
            if step.start > cache.length:
                raise ValueError(f"eagle3: request {rid!r} step starts at position "
                                 f"{step.start}, the head holds {cache.length}: a gap")
            if step.aux.shape[0] != len(step.next_tokens):
                raise ValueError(f"eagle3: request {rid!r} has {step.aux.shape[0]} aux rows "
                                 f"and {len(step.next_tokens)} next tokens")
            if k > 0 and not step.next_tokens:
                raise ValueError(f"eagle3: request {rid!r} asks for drafts with no new position")
        for cache, step in zip(caches, steps):
            cache.truncate(step.start)
        head = self.head
        device = head.fc.weight.device
        fed = [i for i, s in enumerate(steps) if s.next_tokens]
        tokens: list[list[int]] = [[] for _ in rids]
        probs: list[list[float]] = [[] for _ in rids]
        if not fed:
            return HeadDrafts(tokens, probs)
        ids = torch.tensor([t for i in fed for t in steps[i].next_tokens], device=device)
        hidden = head.fuse(torch.cat([steps[i].aux for i in fed]).to(device))
        counts = [len(steps[i].next_tokens) for i in fed]
        out = head(ids, hidden, [caches[i] for i in fed], counts)
        last = out[torch.tensor(counts, device=device).cumsum(0) - 1]
        committed = [c.length for c in caches]
        active = [i for i in fed if ks[i] > 0]
        last = last[[fed.index(i) for i in active]]
        while active:
            p = torch.softmax(head.logits(last).float(), dim=-1)
            best, draft = p.max(dim=-1)
            target_ids = head.to_target(draft)
            for i, token, prob in zip(active, target_ids.tolist(), best.tolist()):
                tokens[i].append(token)
                probs[i].append(prob)
            keep = [row for row, i in enumerate(active) if len(tokens[i]) < ks[i]]
            if not keep:
                break
            active = [active[row] for row in keep]
            last = head(target_ids[keep], last[keep], [caches[i] for i in active],
                        [1] * len(active))
        for cache, n in zip(caches, committed):
            cache.truncate(n)
        return HeadDrafts(tokens, probs)
