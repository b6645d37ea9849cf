"""Speculative acceptance: which draft tokens a verify step keeps, and the one token it adds.

A request proposes ``k_i`` draft tokens ``x_1..x_k`` (``k_i`` may differ per request; the batch
is padded to ``K = max k_i`` and masked). The target scored the ``k_i + 1`` positions, giving
its processed distributions ``p_1..p_{k+1}`` (see `pipeline.sampling`); a draft model gives
``q_1..q_k`` for its drafts. The verify step outputs, per request, in order:

* **accepted tokens**: the longest prefix of drafts that passes verification;
* then exactly one target token, either
  * a **recovered** (correction) token at the first rejected position ``j``, or
  * a **bonus** token at position ``k_i + 1`` when every draft was accepted.

So ``1 <= len(tokens) <= k_i + 1`` and ``num_accepted = len(tokens) - 1``.

**Greedy** (temperature 0): draft ``x_j`` is accepted while it equals the target's argmax at
its position; the recovered/bonus token is the target's argmax at the next position. The output
is exactly what non-speculative greedy decoding would produce.

**Rejection sampling** (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Alg. 1; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling", Alg. 2): accept ``x_j`` with probability
``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection sample the recovered token from the
residual ``normalize(max(0, p_j - q_j))``; if all are accepted sample the bonus from
``p_{k+1}``. Every output token is then distributed exactly as the target's processed
distribution (lossless). Temperature/top-k/top-p are applied to the target logits here and must
have been applied to q the same way by the caller. Edge cases: ``q(x) = 0 < p(x)`` accepts;
``p(x) = 0`` rejects; an all-zero residual (possible only through rounding) falls back to ``p``.

**Point-mass drafts** (n-gram / prompt lookup, no q): ``q_j = one_hot(x_j)``, so ``x_j`` is
accepted with probability ``p_j(x_j)`` and the residual is ``p_j`` with ``x_j`` removed,
renormalised -- still exact.

**Seeded rows** (position-keyed, docs/contracts.md, *Seeds*): the target's sample at output
position ``t`` is ``s_t = sample_from_weights(p_t, u_t)``, ``u_t`` the request's position noise
(`pipeline.sampling.position_uniforms`: a function of seed and position only). A draft is
accepted while it equals ``s_t``; the step's last token is ``s_t`` at the first mismatch or
after the last draft. So a seeded request outputs exactly ``s_1, s_2, ...`` -- what decoding
without drafts gives -- whatever was drafted, however many drafts a step verified, whoever
shared the batch. Each ``s_t`` follows ``p_t`` (Gumbel-max), so the output is lossless.
For a point-mass draft ``x`` this *is* rejection sampling: ``x`` is accepted with probability
``p(x)``, and on rejection ``s_t`` follows ``p`` without ``x``, renormalised -- the residual.
A model draft is coupled instead: a seeded draft model draws ``x_t = sample_from_weights(q_t,
u_t)`` from the same noise, so ``x_t = s_t`` with probability
``P(argmax w_p / E = argmax w_q / E) >= (1 - TV) / (1 + TV)`` (the Gumbel coupling;
``TV = TV(p, q)``), against ``1 - TV`` for rejection sampling: the cost of reproducibility is a
lower acceptance rate where p and q differ much, none where they agree.

Logprobs are of the raw target logits (``log_softmax``, vLLM's default), for every output token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pipeline.sampling import (
    SamplingTensors,
    compute_logprobs,
    position_uniforms,
    process_logits,
    sample_from_weights,
    top_logprobs,
)


@dataclass
class AcceptanceResult:
    """One verify step's output for B requests, padded to K + 1 tokens."""

    token_ids: Tensor  # [B, K+1] int64: accepted drafts then the recovered/bonus token; -1 pad
    num_tokens: Tensor  # [B] int64: new_accepted_len = accepted drafts + 1
    logprobs: Tensor  # [B, K+1] float32: raw target logprob of each token; nan pad
    top_ids: Tensor | None = None  # [B, K+1, N] int64 top-N ids per position (N asked for)
    top_values: Tensor | None = None  # [B, K+1, N] float32 their logprobs

    @property
    def num_accepted(self) -> Tensor:  # [B] int64
        """Accepted draft tokens per request (the recovered/bonus token is not counted)."""
        return self.num_tokens - 1

    def token_lists(self) -> list[list[int]]:
        """Per request, its output tokens (the `VerifyStep.token_ids` layout)."""
        rows = self.token_ids.tolist()
        return [row[:n] for row, n in zip(rows, self.num_tokens.tolist())]

    def logprob_lists(self) -> list[list[float]]:
        """Per request, the raw target logprob of each output token."""
        rows = self.logprobs.tolist()
        return [row[:n] for row, n in zip(rows, self.num_tokens.tolist())]

    def top_logprob_lists(self, num_top: Sequence[int]) -> list[list[list[tuple[int, float]]]]:
        """Per request i, per output token, its top ``num_top[i]`` (id, logprob) pairs (needs
        ``num_top[i] <= N``, the number `accept` was asked for)."""
        if self.top_ids is None or self.top_values is None:
            raise ValueError("top logprobs were not computed (num_top_logprobs=0)")
        if max(num_top, default=0) > self.top_ids.shape[-1]:
            raise ValueError("num_top asks for more top logprobs than were computed")
        ids, values = self.top_ids.tolist(), self.top_values.tolist()
        out = []
        for i, (n, m) in enumerate(zip(self.num_tokens.tolist(), num_top)):
            out.append([list(zip(ids[i][j][:m], values[i][j][:m])) for j in range(n)])
        return out


def greedy_accept(
    draft_token_ids: Tensor,  # [B, K] int64, entries at j >= num_drafts[i] are ignored
    num_drafts: Tensor,  # [B] int64 in [0, K]
    target_argmax: Tensor,  # [B, K+1] int64 target argmax at each position
) -> tuple[Tensor, Tensor]:  # ([B, K+1] int64 tokens, -1 pad; [B] int64 num_tokens)
    """Greedy verification: keep drafts while they equal the target argmax, then append the
    argmax at the first mismatch (recovered) or after all k_i drafts (bonus)."""
    num_pos = draft_token_ids.shape[1]
    valid = torch.arange(num_pos, device=draft_token_ids.device)[None, :] < num_drafts[:, None]
    match = (draft_token_ids == target_argmax[:, :num_pos]) & valid
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    # Accepted drafts equal the argmax, so the output is the argmax prefix of length n + 1.
    return _pad_after(target_argmax, num_accepted + 1), num_accepted + 1


def rejection_accept(
    draft_token_ids: Tensor,  # [B, K] int64, entries at j >= num_drafts[i] are ignored
    num_drafts: Tensor,  # [B] int64 in [0, K]
    target_probs: Tensor,  # [B, K+1, V] float32 processed target distributions p
    draft_probs: Tensor | None,  # [B, K, V] float32 processed draft q; None = point mass
    accept_uniforms: Tensor,  # [B, K] uniform in [0, 1): one acceptance test per draft
    sample_uniforms: Tensor,  # [B, V] uniform in [0, 1): draws the recovered/bonus token
) -> tuple[Tensor, Tensor]:  # ([B, K+1] int64 tokens, -1 pad; [B] int64 num_tokens)
    """Rejection-sampling verification (module docstring). Deterministic given the uniforms:
    draft j is accepted iff ``u_j * q(x_j) < p(x_j)``, the final token is
    ``sample_from_weights(residual or p, sample_uniforms)``."""
    batch, num_pos = draft_token_ids.shape
    device = draft_token_ids.device
    rows = torch.arange(batch, device=device)
    valid = torch.arange(num_pos, device=device)[None, :] < num_drafts[:, None]
    drafts = torch.where(valid, draft_token_ids, torch.zeros_like(draft_token_ids))
    p_draft = target_probs[:, :num_pos].gather(-1, drafts[..., None]).squeeze(-1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    accepted = (accept_uniforms * q_draft < p_draft) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)

    p_final = target_probs[rows, num_accepted]  # [B, V]: p at the recovered/bonus position
    weights = p_final
    rejected = num_accepted < num_drafts
    if num_pos > 0 and bool(rejected.any()):
        at = num_accepted.clamp(max=num_pos - 1)
        if draft_probs is None:
            q_final = torch.zeros_like(p_final)
            q_final[rows, drafts[rows, at]] = 1.0
        else:
            q_final = draft_probs[rows, at].float()
        residual = (p_final - q_final).clamp_min(0.0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_final)
        weights = torch.where(rejected[:, None], residual, p_final)
    final = sample_from_weights(weights, sample_uniforms)

    padded = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)
    padded[rows, num_accepted] = final
    return _pad_after(padded, num_accepted + 1), num_accepted + 1


def position_accept(
    draft_token_ids: Tensor,  # [B, K] int64, entries at j >= num_drafts[i] are ignored
    num_drafts: Tensor,  # [B] int64 in [0, K]
    target_probs: Tensor,  # [B, K+1, V] float32 processed target distributions p
    uniforms: Tensor,  # [B, K+1, V] uniform in [0, 1): the position noise of each position
) -> tuple[Tensor, Tensor]:  # ([B, K+1] int64 tokens, -1 pad; [B] int64 num_tokens)
    """Seeded verification (module docstring): the target's sample at each position is
    ``sample_from_weights(p_j, u_j)``; drafts are kept while they equal it, then the sample at
    the first mismatch (recovered) or after the last draft (bonus) ends the step."""
    batch, width, vocab = target_probs.shape
    samples = sample_from_weights(target_probs.reshape(-1, vocab), uniforms.reshape(-1, vocab))
    return greedy_accept(draft_token_ids, num_drafts, samples.view(batch, width))


def accept(
    draft_token_ids: Tensor,  # [B, K] int64 drafts, padded past num_drafts[i]
    num_drafts: Tensor,  # [B] int64 in [0, K]
    target_logits: Tensor,  # [B, K+1, V] raw target logits at the k_i + 1 verified positions
    sampling: SamplingTensors,  # B rows
    positions: Sequence[int],  # [B] output position of each request's first token this step
    draft_probs: Tensor | None = None,  # [B, K, V] processed draft q; None = point mass (n-gram)
    num_top_logprobs: int = 0,
    generator: torch.Generator | None = None,
    allowed: Tensor | None = None,  # [B, K+1, V] bool grammar mask; None = every token allowed
) -> AcceptanceResult:
    """Verify one step for a batch: greedy rows with `greedy_accept`, seeded sampled rows with
    `position_accept` (their position noise: ``position_uniforms(seed, positions[i] + j)`` at
    position j, so a result depends on neither the batch nor the drafts), unseeded sampled rows
    with `rejection_accept`, drawing from `generator` (None = process RNG); the latter two on
    processed target distributions. `draft_probs` serve only the unseeded rows.
    `positions[i]` is the number of output tokens request i had before this step; a prefill is
    K = 0. `sampling`
    must live on the logits' device. `allowed` (structured output) sets disallowed logits to
    -inf before argmax, processing and rejection sampling, so every output token and the
    residual respect the grammar (p of a disallowed draft is 0: rejected); each row must allow
    at least one token. Logprobs stay those of the raw logits.
    Raises ValueError on inconsistent shapes."""
    _check_shapes(draft_token_ids, num_drafts, target_logits, sampling, positions, draft_probs)
    num_pos = draft_token_ids.shape[1]
    device = target_logits.device
    draft_token_ids = draft_token_ids.long().to(device)
    num_drafts = num_drafts.long().to(device)

    raw_logits = target_logits
    if allowed is not None:
        target_logits = _mask_disallowed(target_logits, allowed)
    tokens, num_tokens = greedy_accept(draft_token_ids, num_drafts, target_logits.argmax(dim=-1))
    seeded = torch.tensor([s is not None for s in sampling.seeds], dtype=torch.bool,
                          device=device)
    sampled = ~sampling.greedy.to(device)
    rows = (sampled & seeded).nonzero().squeeze(-1)
    if rows.numel() > 0:
        tokens[rows], num_tokens[rows] = _position_rows(
            rows, draft_token_ids, num_drafts, target_logits, sampling, positions)
    rows = (sampled & ~seeded).nonzero().squeeze(-1)
    if rows.numel() > 0:
        tokens[rows], num_tokens[rows] = _rejection_rows(
            rows, draft_token_ids, num_drafts, target_logits, sampling, draft_probs, generator)

    logprobs = compute_logprobs(raw_logits)
    chosen = logprobs.gather(-1, tokens.clamp_min(0)[..., None]).squeeze(-1)
    keep = torch.arange(num_pos + 1, device=device)[None, :] < num_tokens[:, None]
    result = AcceptanceResult(tokens, num_tokens, chosen.masked_fill(~keep, float("nan")))
    if num_top_logprobs > 0:
        result.top_ids, result.top_values = top_logprobs(logprobs, num_top_logprobs)
    return result


def accept_greedy_packed(
    draft_token_ids: Tensor,  # [B, K] int64 drafts, padded past num_drafts[i]
    num_drafts: Tensor,  # [B] int64 in [0, K]
    logits: Tensor,  # [N, V] raw target logits, run i's k_i + 1 rows in order, N = sum(k_i + 1)
    num_top_logprobs: int = 0,
) -> AcceptanceResult:
    """`accept` for a batch of greedy rows without grammars, on the logits as the forward packed
    them: argmax and logprobs over the N verified rows only, not the [B, K+1, V] padding (one
    request verifying 4 drafts in a batch of 8 pads 12 rows to 40). Same result as `accept`."""
    num_pos = draft_token_ids.shape[1]
    device = logits.device
    # The index math and the accepted prefixes in numpy (a few ints a row; the argmax comes to
    # the host anyway for the step message): as ~20 tiny torch ops they cost more than a small
    # batch's whole acceptance on CPU.
    nd = num_drafts.long().cpu().numpy()
    run_lens = nd + 1
    if int(run_lens.sum()) != logits.shape[0]:
        raise ValueError(f"logits must hold sum(num_drafts + 1) = {int(run_lens.sum())} rows, "
                         f"got {logits.shape[0]}")
    starts = np.cumsum(run_lens) - run_lens
    # [B, K+1] packed row of each position; past a run's end, its last row (masked below)
    pos = np.arange(num_pos + 1)[None, :]
    rows = starts[:, None] + np.minimum(pos, nd[:, None])
    argmax = logits.argmax(dim=-1).cpu().numpy()[rows]
    # greedy_accept: drafts kept while they equal the argmax, then the argmax
    match = draft_token_ids.long().cpu().numpy() == argmax[:, :num_pos]
    match &= pos[:, :num_pos] < nd[:, None]
    num_tokens = np.cumprod(match, axis=1).sum(axis=1, dtype=np.int64) + 1
    keep = pos < num_tokens[:, None]
    tokens = np.where(keep, argmax, -1)
    logprobs = compute_logprobs(logits)
    rows_t = torch.from_numpy(rows).to(device)
    chosen = logprobs[rows_t, torch.from_numpy(np.maximum(tokens, 0)).to(device)]
    result = AcceptanceResult(
        torch.from_numpy(tokens).to(device), torch.from_numpy(num_tokens).to(device),
        chosen.masked_fill(torch.from_numpy(~keep).to(device), float("nan")))
    if num_top_logprobs > 0:
        ids, values = top_logprobs(logprobs, num_top_logprobs)
        result.top_ids, result.top_values = ids[rows_t], values[rows_t]
    return result


def _mask_disallowed(target_logits: Tensor,  # [B, K+1, V]
                     allowed: Tensor,  # [B, K+1, V] bool
                     ) -> Tensor:
    if tuple(allowed.shape) != tuple(target_logits.shape):
        raise ValueError(f"allowed must be [B, K+1, V] = {tuple(target_logits.shape)}, "
                         f"got {tuple(allowed.shape)}")
    return target_logits.masked_fill(~allowed.to(target_logits.device), float("-inf"))


def _processed(
    rows: Tensor,  # [n] int64 row indices
    target_logits: Tensor,  # [B, K+1, V]
    sampling: SamplingTensors,
) -> Tensor:  # [n, K+1, V] float32
    """The processed target distributions of `rows` at every position."""
    n, width, vocab = rows.numel(), target_logits.shape[1], target_logits.shape[-1]
    sub = sampling.select(rows)
    return process_logits(
        target_logits[rows].reshape(n * width, vocab),
        sub.temperature.repeat_interleave(width),
        sub.top_k.repeat_interleave(width),
        sub.top_p.repeat_interleave(width),
    ).view(n, width, vocab)


def _position_rows(
    rows: Tensor,  # [n] int64 indices of the seeded sampled rows
    draft_token_ids: Tensor,  # [B, K] int64 on the logits' device
    num_drafts: Tensor,  # [B] int64 on the logits' device
    target_logits: Tensor,  # [B, K+1, V] (grammar-masked)
    sampling: SamplingTensors,
    positions: Sequence[int],
) -> tuple[Tensor, Tensor]:
    """`position_accept` over the seeded sampled rows: ([n, K+1] tokens, [n] counts). Only the
    k_i + 1 positions a row verifies get noise (the rest are never read)."""
    width, vocab = target_logits.shape[1], target_logits.shape[-1]
    device = target_logits.device
    p = _processed(rows, target_logits, sampling)
    sub_drafts = num_drafts[rows]
    uniforms = torch.zeros((rows.numel(), width, vocab), dtype=torch.float32, device=device)
    for i, (row, k) in enumerate(zip(rows.tolist(), sub_drafts.tolist())):
        seed = sampling.seeds[row]
        assert seed is not None
        uniforms[i, : k + 1] = position_uniforms(seed, positions[row], k + 1, vocab, device)
    return position_accept(draft_token_ids[rows], sub_drafts, p, uniforms)


def _rejection_rows(
    sampled: Tensor,  # [n] int64 indices of the non-greedy rows
    draft_token_ids: Tensor,  # [B, K] int64 on the logits' device
    num_drafts: Tensor,  # [B] int64 on the logits' device
    target_logits: Tensor,  # [B, K+1, V] (grammar-masked)
    sampling: SamplingTensors,
    draft_probs: Tensor | None,  # [B, K, V] or None
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """`rejection_accept` over the unseeded sampled rows: ([n, K+1] tokens, [n] counts). Their
    uniforms are two batched draws from `generator`: V sampling, then K acceptance uniforms."""
    num_pos, vocab = draft_token_ids.shape[1], target_logits.shape[-1]
    device, n = target_logits.device, sampled.numel()
    p = _processed(sampled, target_logits, sampling)
    sample_u = torch.rand((n, vocab), generator=generator, device=device)
    accept_u = torch.rand((n, num_pos), generator=generator, device=device)
    q = None if draft_probs is None else draft_probs[sampled].float()
    return rejection_accept(draft_token_ids[sampled], num_drafts[sampled], p, q, accept_u,
                            sample_u)


def _pad_after(
    tokens: Tensor,  # [B, K+1] int64
    lengths: Tensor,  # [B] int64
) -> Tensor:  # [B, K+1] int64
    """`tokens` with every entry at index >= lengths[i] set to -1."""
    keep = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]
    return torch.where(keep, tokens, torch.full_like(tokens, -1))


def _check_shapes(
    draft_token_ids: Tensor,  # [B, K]
    num_drafts: Tensor,  # [B]
    target_logits: Tensor,  # [B, K+1, V]
    sampling: SamplingTensors,
    positions: Sequence[int],
    draft_probs: Tensor | None,  # [B, K, V]
) -> None:
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [B, K], got {tuple(draft_token_ids.shape)}")
    batch, num_pos = draft_token_ids.shape
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (batch, num_pos + 1):
        raise ValueError(
            f"target_logits must be [B, K+1, V] = [{batch}, {num_pos + 1}, V], "
            f"got {tuple(target_logits.shape)}"
        )
    if tuple(num_drafts.shape) != (batch,):
        raise ValueError(f"num_drafts must be [{batch}], got {tuple(num_drafts.shape)}")
    if len(sampling) != batch or len(positions) != batch:
        raise ValueError("sampling and positions need one entry per request")
    if batch and (int(num_drafts.min()) < 0 or int(num_drafts.max()) > num_pos):
        raise ValueError(f"num_drafts must lie in [0, {num_pos}]")
    vocab = target_logits.shape[-1]
    valid = torch.arange(num_pos)[None, :] < num_drafts.cpu()[:, None]
    drafts = draft_token_ids.cpu()[valid]
    if drafts.numel() and (int(drafts.min()) < 0 or int(drafts.max()) >= vocab):
        raise ValueError(f"draft token ids must lie in [0, {vocab})")
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, num_pos, vocab):
        raise ValueError(
            f"draft_probs must be [B, K, V] = [{batch}, {num_pos}, {vocab}], "
            f"got {tuple(draft_probs.shape)}"
        )
