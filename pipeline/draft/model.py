"""A draft model with its own KV cache proposes k tokens autoregressively; `commit` keeps the
cache the accepted tokens confirm, so a rollback is a length update, never a recompute."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.draft.base import Proposal, Proposer
from pipeline.models.runner import ModelRunner
from pipeline.params import SamplingParams
from pipeline.sampling import STREAM_ACCEPT, SamplingTensors, sample_tokens


@dataclass
class _DraftSeq:
    slot: int
    params: SamplingParams
    num_prompt: int
    tokens: list[int]
    cached: int = 0  # tokens[:cached] are in the draft KV cache (and nothing after them)
    drafted: list[int] = field(default_factory=list)  # drafts fed into the cache past `cached`


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._seqs: dict[str, _DraftSeq] = {}

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            tenant: str = "") -> None:
        if rid in self._seqs:
            raise ValueError(f"draft: request {rid!r} already added")
        slot = self.runner.allocate()
        cached = self.runner.attach_prefix(slot, prompt_ids)
        self._seqs[rid] = _DraftSeq(slot, params, len(prompt_ids), list(prompt_ids), cached)

    def prefill(self, rids: list[str], counts: list[int]) -> None:
        seqs, runs = [], []
        for rid, n in zip(rids, counts):
            s = self._seqs[rid]
            run = s.tokens[s.cached:min(s.num_prompt, s.cached + n)]
            if run:
                seqs.append(s)
                runs.append(run)
        if not seqs:
            return
        self.runner.forward([s.slot for s in seqs], runs, last_only=True)
        for s in seqs:
            s.cached = self.runner.length(s.slot)
            self.runner.truncate(s.slot, s.cached)  # prompt tokens: committed, cacheable

    def propose(self, rids: list[str], ks: list[int]) -> Proposal:
        tokens: list[list[int]] = [[] for _ in rids]
        probs: list[list[torch.Tensor]] = [[] for _ in rids]
        active = [i for i, k in enumerate(ks) if k > 0]
        runs = {i: self._seqs[rids[i]].tokens[self._seqs[rids[i]].cached:] for i in active}
        depth = 0
        while active:
            seqs = [self._seqs[rids[i]] for i in active]
            logits = self.runner.forward([s.slot for s in seqs], [runs[i] for i in active])
            last = torch.cat([lg[-1:] for lg in logits])
            sampling = SamplingTensors.from_params([s.params for s in seqs], last.device)
            offsets = [len(s.tokens) - s.num_prompt + depth for s in seqs]
            # a seeded row draws the target's position noise (pipeline.verify.acceptance)
            picked, q = sample_tokens(last, sampling, offsets, STREAM_ACCEPT)
            for row, i in enumerate(active):
                tokens[i].append(int(picked[row]))
                probs[i].append(q[row].cpu())  # q travels between processes on the CPU
            for i in active:
                if depth > 0:
                    self._seqs[rids[i]].drafted.append(runs[i][0])
            depth += 1
            active = [i for i in active if len(tokens[i]) < ks[i]]
            runs = {i: [tokens[i][-1]] for i in active}
        # greedy and seeded drafts are verified by equality: no q to send
        out_probs = [None if _no_q(self._seqs[rid].params) else _stack(p, self.runner.vocab_size)
                     for rid, p in zip(rids, probs)]
        return Proposal(tokens=tokens, probs=out_probs)

    def commit(self, rid: str, accepted: list[int]) -> None:
        s = self._seqs[rid]
        # keep the longest prefix of what the cache holds that the new sequence agrees with
        held = self.runner.length(s.slot)
        old_len = len(s.tokens)
        s.tokens.extend(accepted)
        keep = min(held, old_len)
        if held > old_len:
            for d, a in zip(s.drafted, accepted):
                if d != a:
                    break
                keep += 1
        keep = min(keep, len(s.tokens) - 1)  # the newest token is always fed next time
        self.runner.truncate(s.slot, keep)
        s.cached = keep
        s.drafted = []

    def requests(self) -> list[str]:
        return list(self._seqs)

    def remove(self, rid: str) -> None:
        s = self._seqs.pop(rid, None)
        if s is not None:
            self.runner.free(s.slot)


def _no_q(params: SamplingParams) -> bool:
    return params.greedy or params.seed is not None


def _stack(rows: list[torch.Tensor], vocab: int) -> torch.Tensor:
    return torch.stack(rows) if rows else torch.zeros((0, vocab))
