"""The target side of a step: prefill, verify drafts, build the step message. Every
tensor-parallel rank runs `step` with the same plan in lockstep; only the driver (rank 0) runs
acceptance. KV commit is lazy and identical on every rank (a verify appends [last + drafts], the
next plan's `kv_lens` truncates back), and block managers are deterministic, so ranks exchange
nothing but digests (`agree`, pipeline.verify.ranks), which make a divergence fail loudly."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.grammar.tracker import GrammarTracker
from pipeline.models.runner import ModelRunner
from pipeline.params import SamplingParams
from pipeline.protocol import (
    HiddenStates,
    Proposal,
    RankReport,
    StepColumns,
    StepOutcome,
    StepPlan,
    encode_columns,
)
from pipeline.sampling import SamplingTensors
from pipeline.verify.acceptance import AcceptanceResult, accept, accept_greedy_packed


@dataclass
class _Request:
    slot: int
    params: SamplingParams
    prompt_ids: list[int]  # a resumed request's output included
    num_output: int  # its first token's output position
    hit: int = 0
    prefilling: bool = True
    last: int = -1  # rank 0: its last sample, which a plan's last token -1 stands for


class Verifier:
    def __init__(self, runner: ModelRunner, driver: bool = True,
                 generator: torch.Generator | None = None,
                 agree: Callable[[bytes, str], None] | None = None,
                 aux_layers: list[int] | None = None,
                 share: Callable[[list[int]], list[int]] | None = None) -> None:
        """`agree(digest, what)`: raises on every rank when the ranks' digests differ.
        `aux_layers`: an EAGLE-3 draft's; rank 0 returns their states (`StepOutcome.hidden`).
        `share(tokens)`: rank 0's tokens on every rank (its samples, for a plan's last token -1)."""
        self.runner = runner
        self.aux_layers = list(aux_layers or [])
        self.driver = driver
        self.generator = generator
        self.agree = agree
        self.share = share
        self.kv_digest = b""
        self._requests: dict[str, _Request] = {}
        self.grammars = GrammarTracker(lambda: runner.tokenizer)

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            req = self._requests.pop(rid, None)
            if req is not None:
                self.runner.free(req.slot)

    def reset(self) -> int:
        """Release every request (the prefix cache stays: it depends on tokens alone); returns
        how many there were."""
        rids = list(self._requests)
        self.release(rids)
        self.grammars.reset()
        self.kv_digest = self.runner.cache.digest()
        return len(rids)

    def step(self, plan: StepPlan, proposal: Proposal | None) -> StepOutcome | None:
        self.release(plan.release)
        # a plan out of step with this rank is refused before any slot or forward
        more = [self._next_chunk(*c) for c in zip(plan.prefills, plan.prefill_starts,
                                                  plan.prefill_ends)]
        cached, chunks = self._admit(plan)  # chunks: (rid, prompt ids, start, end)
        chunks += more
        for rid, ids, _, end in chunks:
            if end == len(ids):
                self._requests[rid].prefilling = False
        if self.driver:
            self.grammars.apply(plan)
        if not plan.rids:
            self.kv_digest = self.runner.cache.digest()
            return StepOutcome(plan.step, [], [], [], kv_digest=self.kv_digest) \
                if self.driver else None
        drafts = self._drafts(plan, proposal)
        logits, aux, decode_s = self._forward(plan, chunks, drafts)
        self.kv_digest = self.runner.cache.digest()
        done = [i for i, (_, ids, _, end) in enumerate(chunks) if end == len(ids)]
        ended = [self._requests[chunks[i][0]] for i in done]
        positions = [r.num_output for r in ended] + list(plan.num_outputs)
        hits = [r.hit for r in ended]
        if not self.driver:
            return None
        start = time.perf_counter()
        rids = [chunks[i][0] for i in done] + plan.decode
        if len(done) < len(chunks):
            keep = done + list(range(len(chunks), logits.shape[0]))
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
        params = [self._requests[rid].params for rid in rids]
        all_drafts = [[] for _ in done] + drafts
        outcome = StepOutcome(plan.step, [], [], [], cached=cached)
        if rids:
            q = self._draft_probs(proposal, all_drafts, len(done))
            allowed = self.grammars.masks(rids, all_drafts, max(len(d) for d in all_drafts) + 1,
                                          logits.shape[-1])
            result = _accept(logits, all_drafts, params, positions, q, self.generator, allowed)
            outcome = _outcome(plan.step, rids, plan.traceparent, result, all_drafts, params,
                               hits, len(plan.decode))
            outcome.cached = cached
            for rid, tokens in zip(rids, outcome.tokens):
                self._requests[rid].last = tokens[-1]
        outcome.kv_digest = self.kv_digest
        if aux is not None:
            outcome.hidden = _kept_states(plan, chunks, drafts, aux, outcome.tokens[len(done):])
        if proposal is not None and proposal.confidence is not None:
            outcome.expected = [None] * len(done) + [
                float(sum(c[: len(d)])) for c, d in zip(proposal.confidence, drafts)]
        if plan.decode and decode_s is not None:
            outcome.decode_s = (decode_s + time.perf_counter() - start
                                + (proposal.seconds if proposal is not None else 0.0))
        return outcome

    def report(self, step: int, rank: int) -> RankReport:
        return RankReport(step, rank, self.kv_digest)

    def _admit(self, plan: StepPlan) -> tuple[list[int], list[tuple[str, list[int], int, int]]]:
        cached, chunks = [], []
        for new in plan.new:
            if new.rid in self._requests:
                raise ValueError(f"verifier: request {new.rid!r} is already running")
            req = self._requests[new.rid] = _Request(self.runner.allocate(), new.params,
                                                     new.prompt_ids, new.num_output)
            # an EAGLE-3 head needs every position's states: a cached prefix has none
            req.hit = hit = 0 if self.aux_layers else self.runner.attach_prefix(
                req.slot, new.prompt_ids)
            cached.append(hit)
            end = len(new.prompt_ids) if new.chunk is None else min(len(new.prompt_ids),
                                                                     hit + new.chunk)
            chunks.append((new.rid, new.prompt_ids, hit, end))
        if plan.new and self.agree is not None:  # the hits set this forward's shapes
            self.agree(self.runner.cache.digest(), f"step {plan.step}'s prefix-cache hits")
        return cached, chunks

    def _next_chunk(self, rid: str, start: int, end: int) -> tuple[str, list[int], int, int]:
        req = self._requests.get(rid)
        if req is None or not req.prefilling:
            raise ValueError(f"verifier: request {rid!r} has no prefill under way")
        ids = req.prompt_ids
        held = self.runner.length(req.slot)
        if start != held or end > len(ids):
            raise ValueError(f"verifier: chunk [{start}, {end}) of {rid!r} does not continue "
                             f"its prefill ({held} of {len(ids)} tokens computed)")
        return rid, ids, start, end

    def _drafts(self, plan: StepPlan, proposal: Proposal | None) -> list[list[int]]:
        if proposal is None:
            return [[] for _ in plan.decode]
        limits = plan.draft_limits(self.runner.max_len)
        return [list(tokens[:n]) for tokens, n in zip(proposal.tokens, limits)]

    def _forward(self, plan: StepPlan, chunks: list[tuple[str, list[int], int, int]],
                 drafts: list[list[int]]
                 ) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
        """Packed [N, V] logits (a row per prefill chunk, 1 + k per verify), rank 0's aux
        states of every token when asked, and the forward's seconds when it held decodes only.
        One forward for both: its fixed cost (every weight read once) is paid once a step."""
        slots = [self._requests[rid].slot for rid, _, _, _ in chunks]
        runs = [ids[start:end] for _, ids, start, end in chunks]
        decode_slots = [self._requests[rid].slot for rid in plan.decode]
        for slot, kv_len in zip(decode_slots, plan.kv_lens):
            self.runner.truncate(slot, kv_len)  # lazy commit of the previous step
        slots += decode_slots
        runs += [[last] + d for last, d in zip(self._last_tokens(plan), drafts)]
        start = time.perf_counter()
        capture = self.aux_layers if self.driver else None
        out = self.runner.forward(slots, runs, last_only=[True] * len(chunks)
                                  + [False] * len(plan.decode), packed=True, aux_layers=capture)
        logits, aux = out if capture else (out, None)
        seconds = time.perf_counter() - start
        for slot in slots[: len(chunks)]:  # committed: full blocks become cacheable
            self.runner.truncate(slot, self.runner.length(slot))
        return logits, aux, seconds if not chunks else None

    def _last_tokens(self, plan: StepPlan) -> list[int]:
        lasts = list(plan.last_tokens)
        ask = [i for i, t in enumerate(lasts) if t < 0]  # the same rows on every rank
        if not ask:
            return lasts
        sampled = [self._requests[plan.decode[i]].last for i in ask]
        if self.share is not None:
            sampled = self.share(sampled)
        for i, token in zip(ask, sampled):
            if token < 0:
                raise ValueError(f"verifier: the plan asks for the token the last step sampled "
                                 f"for {plan.decode[i]!r}, which this rank does not hold")
            lasts[i] = token
        return lasts

    def _draft_probs(self, proposal: Proposal | None, drafts: list[list[int]],
                     offset: int) -> torch.Tensor | None:
        if proposal is None or proposal.probs is None or all(p is None for p in proposal.probs):
            return None
        width = max((len(d) for d in drafts), default=0)
        vocab = self.runner.vocab_size
        q = torch.zeros((len(drafts), width, vocab), device=self.runner.device)
        for i, (p, d) in enumerate(zip(proposal.probs, drafts[offset:])):
            if p is not None and d:
                # a CPU tensor in process, a numpy array after crossing one (step_codec)
                q[offset + i, : len(d)] = torch.as_tensor(p[: len(d)]).to(q.device)
        return q


def _kept_states(plan: StepPlan, chunks: list[tuple[str, list[int], int, int]],
                 drafts: list[list[int]], aux: torch.Tensor, decode_tokens: list[list[int]]
                 ) -> HiddenStates:
    """Every prefilled position's states, and each verify's kept ones (its newest token's and
    the accepted drafts'), as EAGLE feeds its head; bfloat16 unless the target runs float16."""
    rids, starts, counts, rows, at = [], [], [], [], 0
    for rid, _, start, end in chunks:
        rids.append(rid)
        starts.append(start)
        counts.append(end - start)
        rows.extend(range(at, at + end - start))
        at += end - start
    for rid, kv_len, d, kept in zip(plan.decode, plan.kv_lens, drafts, decode_tokens):
        rids.append(rid)
        starts.append(kv_len)
        counts.append(len(kept))
        rows.extend(range(at, at + len(kept)))
        at += 1 + len(d)
    dtype = torch.float16 if aux.dtype == torch.float16 else torch.bfloat16
    picked = aux[torch.tensor(rows, dtype=torch.long, device=aux.device)]
    return HiddenStates(rids, starts, counts, picked.to(dtype).cpu())


def _accept(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
            positions: list[int], q: torch.Tensor | None,
            generator: torch.Generator | None, allowed: np.ndarray | None) -> AcceptanceResult:
    lens = [len(d) for d in drafts]
    width = max(lens)
    batch, vocab = len(drafts), logits.shape[-1]
    device = logits.device
    # built in numpy: a torch.tensor per row costs microseconds each
    ids = np.zeros((batch, width), dtype=np.int64)
    if width:
        ids[np.repeat(np.arange(batch), lens), _within(lens)] = np.fromiter(
            itertools.chain.from_iterable(drafts), dtype=np.int64, count=sum(lens))
    draft_ids = torch.from_numpy(ids).to(device)
    num_drafts = torch.from_numpy(np.array(lens, dtype=np.int64)).to(device)
    top_n = max((p.logprobs or 0 for p in params), default=0)
    if allowed is None and all(p.greedy for p in params):
        return accept_greedy_packed(draft_ids, num_drafts, logits, top_n)
    padded = torch.zeros((batch, width + 1, vocab), device=device)
    for i, lg in enumerate(logits.split([n + 1 for n in lens])):
        padded[i, : lg.shape[0]] = lg
    sampling = SamplingTensors.from_params(params, device)
    mask = None if allowed is None else torch.from_numpy(allowed).to(device)
    return accept(draft_ids, num_drafts, padded, sampling, positions, draft_probs=q,
                  num_top_logprobs=top_n, generator=generator, allowed=mask)


def _outcome(step: int, rids: list[str], traceparent: str | None, result: AcceptanceResult,
             drafts: list[list[int]], params: list[SamplingParams], hits: list[int],
             num_decode: int) -> StepOutcome:
    lengths = result.num_tokens.cpu().numpy().astype(np.int64, copy=False)
    keep = np.arange(result.token_ids.shape[1])[None, :] < lengths[:, None]
    tokens = result.token_ids.cpu().numpy()[keep].astype(np.int64, copy=False)
    top_n = top_ids = top_lps = None
    tn = [p.logprobs or 0 for p in params]
    if any(tn):  # each request gets its own N of the step's max-N top-logprobs
        ids, vals = result.top_ids.cpu().numpy(), result.top_values.cpu().numpy()
        top_n = np.array(tn, dtype=np.int64)
        top_ids = np.concatenate(
            [ids[i, :n, :t].reshape(-1) for i, (n, t) in enumerate(zip(lengths, tn))]
        ).astype(np.int64)
        top_lps = np.concatenate(
            [vals[i, :n, :t].reshape(-1) for i, (n, t) in enumerate(zip(lengths, tn))]
        ).astype(np.float64)
    cols = StepColumns(
        step=step, rids=rids, lengths=lengths,
        drafted=np.array([len(d) for d in drafts], dtype=np.int64), tokens=tokens,
        logprobs=result.logprobs.cpu().numpy()[keep].astype(np.float64, copy=False),
        top_n=top_n, top_ids=top_ids, top_logprobs=top_lps,
        traceparent=traceparent, time=time.time(),
        cached=np.array(hits + [0] * num_decode, dtype=np.int64) if hits else None,
    )
    flat, ends = tokens.tolist(), np.cumsum(lengths).tolist()  # no array per row
    token_lists = [flat[e - n: e] for e, n in zip(ends, lengths.tolist())]
    return StepOutcome(step=step, rids=rids, tokens=token_lists,
                       drafted=[len(d) for d in drafts], payload=encode_columns(cols))


def _within(lens: list[int]) -> np.ndarray:
    n = np.array(lens, dtype=np.int64)
    return np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
