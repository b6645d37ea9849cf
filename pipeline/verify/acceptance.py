"""Speculative acceptance: which drafts a verify step keeps, and the one target token it adds
(recovered at the first rejection, bonus after all k_i drafts). Shapes: B requests, K = max k_i,
V vocab; drafts [B, K] (ignored past num_drafts [B]), target [B, K+1, V], draft q [B, K, V]
processed like p (None: point masses); tokens [B, K+1], -1 pad. Logprobs: of the raw logits.

- Greedy: drafts kept while they equal the target argmax: exactly non-speculative greedy.
- Rejection sampling (Leviathan et al. 2023): accept x_j with probability
  min(1, p_j(x_j) / q_j(x_j)), else sample normalize(max(0, p_j - q_j)) (all zero: p).
- Seeded rows (docs/contracts.md, *Seeds*): the target's sample at output position t is
  s_t = sample_from_weights(p_t, u_t), u_t a function of seed and position only; drafts are kept
  while they equal s_t, so the output is s_1, s_2, ... whatever was drafted (Gumbel-max). A
  seeded draft model draws from the same u_t: accepted with probability >= (1 - TV) / (1 + TV).
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
    token_ids: Tensor
    num_tokens: Tensor  # accepted drafts + 1
    logprobs: Tensor
    top_ids: Tensor | None = None
    top_values: Tensor | None = None

    @property
    def num_accepted(self) -> Tensor:
        return self.num_tokens - 1

    def token_lists(self) -> list[list[int]]:
        rows = self.token_ids.tolist()
        return [row[:n] for row, n in zip(rows, self.num_tokens.tolist())]

    def logprob_lists(self) -> list[list[float]]:
        rows = self.logprobs.tolist()
        return [row[:n] for row, n in zip(rows, self.num_tokens.tolist())]

    def top_logprob_lists(self, num_top: Sequence[int]) -> list[list[list[tuple[int, float]]]]:
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
    draft_token_ids: Tensor,
    num_drafts: Tensor,
    target_argmax: Tensor,
) -> tuple[Tensor, Tensor]:
    num_pos = draft_token_ids.shape[1]
    valid = torch.arange(num_pos, device=draft_token_ids.device)[None, :] < num_drafts[:, None]
    match = (draft_token_ids == target_argmax[:, :num_pos]) & valid
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    # accepted drafts equal the argmax, so the output is the argmax prefix of length n + 1
    return _pad_after(target_argmax, num_accepted + 1), num_accepted + 1


def rejection_accept(
    draft_token_ids: Tensor,
    num_drafts: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None,
    accept_uniforms: Tensor,
    sample_uniforms: Tensor,
) -> tuple[Tensor, Tensor]:
    """Deterministic given the uniforms: draft j is accepted iff u_j * q(x_j) < p(x_j)."""
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

    p_final = target_probs[rows, num_accepted]
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
    draft_token_ids: Tensor,
    num_drafts: Tensor,
    target_probs: Tensor,
    uniforms: Tensor,
) -> tuple[Tensor, Tensor]:
    batch, width, vocab = target_probs.shape
    samples = sample_from_weights(target_probs.reshape(-1, vocab), uniforms.reshape(-1, vocab))
    return greedy_accept(draft_token_ids, num_drafts, samples.view(batch, width))


def accept(
    draft_token_ids: Tensor,
    num_drafts: Tensor,
    target_logits: Tensor,
    sampling: SamplingTensors,
    positions: Sequence[int],
    draft_probs: Tensor | None = None,
    num_top_logprobs: int = 0,
    generator: torch.Generator | None = None,
    allowed: Tensor | None = None,
) -> AcceptanceResult:
    """Verify a batch from raw target logits: greedy, seeded (noise at `positions[i]`, request
    i's output tokens before this step) and unseeded sampled rows (`generator`) each by its rule.
    `allowed` [B, K+1, V] masks logits before all of it (each row must allow a token)."""
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
    draft_token_ids: Tensor,
    num_drafts: Tensor,
    logits: Tensor,
    num_top_logprobs: int = 0,
) -> AcceptanceResult:
    """`accept` for greedy rows without grammars, on the packed logits [sum(k_i + 1), V]."""
    num_pos = draft_token_ids.shape[1]
    device = logits.device
    # numpy: as ~20 tiny torch ops this index math costs more than a small batch's acceptance
    nd = num_drafts.long().cpu().numpy()
    run_lens = nd + 1
    if int(run_lens.sum()) != logits.shape[0]:
        raise ValueError(f"logits must hold sum(num_drafts + 1) = {int(run_lens.sum())} rows, "
                         f"got {logits.shape[0]}")
    starts = np.cumsum(run_lens) - run_lens
    # the packed row of each position; past a run's end its last row (masked below)
    pos = np.arange(num_pos + 1)[None, :]
    rows = starts[:, None] + np.minimum(pos, nd[:, None])
    argmax = logits.argmax(dim=-1).cpu().numpy()[rows]
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


def _mask_disallowed(target_logits: Tensor,
                     allowed: Tensor,
                     ) -> Tensor:
    if tuple(allowed.shape) != tuple(target_logits.shape):
        raise ValueError(f"allowed must be [B, K+1, V] = {tuple(target_logits.shape)}, "
                         f"got {tuple(allowed.shape)}")
    return target_logits.masked_fill(~allowed.to(target_logits.device), float("-inf"))


def _processed(
    rows: Tensor,
    target_logits: Tensor,
    sampling: SamplingTensors,
) -> Tensor:
    n, width, vocab = rows.numel(), target_logits.shape[1], target_logits.shape[-1]
    sub = sampling.select(rows)
    return process_logits(
        target_logits[rows].reshape(n * width, vocab),
        sub.temperature.repeat_interleave(width),
        sub.top_k.repeat_interleave(width),
        sub.top_p.repeat_interleave(width),
    ).view(n, width, vocab)


def _position_rows(
    rows: Tensor,
    draft_token_ids: Tensor,
    num_drafts: Tensor,
    target_logits: Tensor,
    sampling: SamplingTensors,
    positions: Sequence[int],
) -> tuple[Tensor, Tensor]:
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
    sampled: Tensor,
    draft_token_ids: Tensor,
    num_drafts: Tensor,
    target_logits: Tensor,
    sampling: SamplingTensors,
    draft_probs: Tensor | None,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    num_pos, vocab = draft_token_ids.shape[1], target_logits.shape[-1]
    device, n = target_logits.device, sampled.numel()
    p = _processed(sampled, target_logits, sampling)
    sample_u = torch.rand((n, vocab), generator=generator, device=device)
    accept_u = torch.rand((n, num_pos), generator=generator, device=device)
    q = None if draft_probs is None else draft_probs[sampled].float()
    return rejection_accept(draft_token_ids[sampled], num_drafts[sampled], p, q, accept_u,
                            sample_u)


def _pad_after(
    tokens: Tensor,
    lengths: Tensor,
) -> Tensor:
    keep = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]
    return torch.where(keep, tokens, torch.full_like(tokens, -1))


def _check_shapes(
    draft_token_ids: Tensor,
    num_drafts: Tensor,
    target_logits: Tensor,
    sampling: SamplingTensors,
    positions: Sequence[int],
    draft_probs: Tensor | None,
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
