"""Sampling math as pure tensor functions. Rules shared across specrelay:

* Processed distribution: temperature, top-k, top-p (vLLM's order), softmax; a greedy row
  (temperature 0) is the one-hot of the raw argmax. top-k keeps the k largest scaled logits;
  top-p then keeps the smallest most-likely-first prefix with mass >= top_p (never empty).
* Randomness comes from uniform tensors. A seeded request draws from its own generator seeded
  with ``derive_seed(seed, offset, stream)``, so its tokens do not depend on its batch; its
  *position noise* at output position t (STREAM_ACCEPT) fixes its token there whatever was
  drafted, and a seeded draft model draws from the same noise (coupled drafts).
* Logprobs are ``log_softmax`` of the raw logits, like vLLM's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.params import SamplingParams

STREAM_DRAFT = 0
STREAM_ACCEPT = 1

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingTensors:
    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    seeds: list[int | None]

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
    ) -> SamplingTensors:
        return cls(
            temperature=torch.tensor(
                [float(p.temperature) for p in params], dtype=torch.float32, device=device
            ),
            top_k=torch.tensor([int(p.top_k) for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor(
                [float(p.top_p) for p in params], dtype=torch.float32, device=device
            ),
            seeds=[p.seed for p in params],
        )

    def __len__(self) -> int:
        return len(self.seeds)

    @property
    def greedy(self) -> Tensor:
        return self.temperature == 0

    def select(self, rows: Tensor) -> SamplingTensors:
        idx = rows.tolist()
        return SamplingTensors(
            temperature=self.temperature[rows],
            top_k=self.top_k[rows],
            top_p=self.top_p[rows],
            seeds=[self.seeds[i] for i in idx],
        )


def process_logits(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,  # <= 0 or >= V: disabled
    top_p: Tensor,  # >= 1: disabled
) -> Tensor:  # [R, V] float32 probabilities
    """Each row needs a finite logit; -inf (masked) logits get probability 0."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits / temp[:, None]
    use_top_k = (top_k > 0) & (top_k < vocab)
    use_top_p = top_p < 1.0
    if bool((use_top_k | use_top_p).any()):
        scaled = _apply_top_k_top_p(scaled, torch.where(use_top_k, top_k, vocab), top_p.float())
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _apply_top_k_top_p(
    scaled: Tensor,
    k: Tensor,  # in [1, V]
    top_p: Tensor,
) -> Tensor:  # removed tokens set to -inf
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    keep = rank[None, :] < k[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep[:, 0] = True
    keep_unsorted = torch.zeros_like(keep).scatter_(-1, order, keep)
    return scaled.masked_fill(~keep_unsorted, float("-inf"))


def sample_from_weights(
    weights: Tensor,  # [R, V] non-negative, not necessarily normalised
    uniforms: Tensor,
) -> Tensor:
    """Token i with probability w_i / sum(w): the exponential race argmax(w / E), E = -log(1 - u),
    a form of the Gumbel-max trick."""
    exp = (-torch.log1p(-uniforms.float())).clamp_min(torch.finfo(torch.float32).tiny)
    return (weights.float() / exp).argmax(dim=-1)


def derive_seed(seed: int, offset: int, stream: int) -> int:
    # splitmix64, so neighbouring offsets and streams give unrelated generator states
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ (offset & _MASK64))
    return _splitmix64(x ^ (stream & _MASK64))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_generator(
    seed: int, offset: int, stream: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, offset, stream))
    return gen


def draw_uniforms(
    num: int,
    seeds: Sequence[int | None],
    offsets: Sequence[int],
    stream: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> Tensor:  # [R, num] float32 uniform in [0, 1)
    """Unseeded rows share one batched draw from `generator` (None: the device's process RNG)."""
    out = torch.empty((len(seeds), num), dtype=torch.float32, device=device)
    unseeded = [i for i, s in enumerate(seeds) if s is None]
    for i, seed in enumerate(seeds):
        if seed is not None:
            gen = request_generator(seed, offsets[i], stream, device)
            out[i] = torch.rand(num, generator=gen, device=device)
    if unseeded:
        rows = torch.tensor(unseeded, dtype=torch.int64, device=device)
        out[rows] = torch.rand((len(unseeded), num), generator=generator, device=device)
    return out


def position_uniforms(
    seed: int,
    first: int,
    num: int,
    vocab: int,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Position noise at output positions first .. first + num - 1."""
    return draw_uniforms(vocab, [seed] * num, range(first, first + num), STREAM_ACCEPT, device)


def sample_tokens(
    logits: Tensor,
    sampling: SamplingTensors,
    offsets: Sequence[int],
    stream: int = STREAM_DRAFT,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:  # ([R] int64 tokens, [R, V] float32 processed probs)
    probs = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    tokens = logits.argmax(dim=-1)
    if not bool(sampling.greedy.all()):
        uniforms = draw_uniforms(
            probs.shape[-1], sampling.seeds, offsets, stream, logits.device, generator
        )
        tokens = torch.where(sampling.greedy, tokens, sample_from_weights(probs, uniforms))
    return tokens, probs


def compute_logprobs(logits: Tensor) -> Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(
    logprobs: Tensor,
    token_ids: Tensor,
) -> Tensor:
    return logprobs.gather(-1, token_ids[:, None]).squeeze(-1)


def top_logprobs(
    logprobs: Tensor,
    num: int,
) -> tuple[Tensor, Tensor]:  # ids and logprobs, most likely first
    n = min(num, logprobs.shape[-1])
    values, ids = logprobs.topk(n, dim=-1)
    return ids, values
