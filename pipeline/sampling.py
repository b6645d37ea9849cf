"""Sampling math as pure tensor functions: logits processing, seeded randomness, logprobs.

Definitions used across specrelay:

* **Processed distribution** of a row of logits: temperature, then top-k, then top-p (vLLM's
  order), then softmax. Greedy rows (temperature 0) have the one-hot of the raw argmax as their
  processed distribution, so a greedy request is the zero-temperature limit of a sampled one.
* **top-k**: keep the k largest temperature-scaled logits (ties broken by sort order); k <= 0
  or k >= V disables it.
* **top-p** (nucleus): after top-k, keep the smallest prefix of the tokens sorted by probability
  (descending) whose total probability is >= top_p; the most likely token is always kept;
  top_p >= 1 disables it.
* **Randomness**: every random number comes from a *uniform tensor* the caller can draw itself.
  A request with a seed draws its uniforms from its own ``torch.Generator`` seeded with
  ``derive_seed(seed, offset, stream)``, where ``offset`` is an output position and ``stream``
  names the purpose. The draw depends on nothing else, so a seeded request's tokens are
  reproducible and independent of which other requests share its batch and in which order.
  Requests without a seed draw from one batched call on a shared generator (the process RNG
  by default).
* **Position noise** of a seeded request: the ``V`` uniforms ``u_t`` of
  ``request_generator(seed, t, STREAM_ACCEPT)`` (``position_uniforms``). Its token at output
  position ``t`` is ``sample_from_weights(p_t, u_t)`` whatever was drafted (Gumbel-max with
  noise keyed by (seed, position); the front end gives each choice its own seed), and a seeded
  draft model draws its draft for position ``t`` from the same ``u_t`` (coupled drafts; see
  `pipeline.verify.acceptance`).
* **Sampling from weights** ``w`` (non-negative, not necessarily normalised) with uniforms
  ``u``: ``argmax(w / E)`` with ``E = -log(1 - u)`` exponential; this picks token ``i`` with
  probability ``w_i / sum(w)`` (the exponential-race form of the Gumbel-max trick).
* **Logprobs** are ``log_softmax`` of the *raw* (unprocessed) logits, like vLLM's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.params import SamplingParams

STREAM_DRAFT = 0  # draft-model sampling of speculative tokens (unused by seeded rows)
# a seeded request's position noise: the target's sample at a position (and its coupled draft)
STREAM_ACCEPT = 1

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch, as tensors (one row per request)."""

    temperature: Tensor  # [R] float32, 0 = greedy
    top_k: Tensor  # [R] int64, <= 0 = disabled
    top_p: Tensor  # [R] float32 in (0, 1]
    seeds: list[int | None]  # [R] per-request seed, None = shared generator

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
    ) -> SamplingTensors:
        """Gather the sampling fields of `params` (one per row) into tensors on `device`."""
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
        """[R] bool: rows that take the argmax."""
        return self.temperature == 0

    def select(self, rows: Tensor) -> SamplingTensors:
        """The sub-batch of `rows` ([n] int64 row indices), in that order."""
        idx = rows.tolist()
        return SamplingTensors(
            temperature=self.temperature[rows],
            top_k=self.top_k[rows],
            top_p=self.top_p[rows],
            seeds=[self.seeds[i] for i in idx],
        )


def process_logits(
    logits: Tensor,  # [R, V] raw logits (any float dtype)
    temperature: Tensor,  # [R] float, 0 = greedy
    top_k: Tensor,  # [R] int, <= 0 or >= V = disabled
    top_p: Tensor,  # [R] float in (0, 1], >= 1 = disabled
) -> Tensor:  # [R, V] float32 probabilities
    """The processed distribution of every row (see the module docstring): temperature, top-k,
    top-p, softmax; greedy rows become the one-hot of their raw argmax. Logits of -inf (masked
    tokens) get probability 0; a row must have at least one finite logit."""
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
    scaled: Tensor,  # [R, V] float32 temperature-scaled logits
    k: Tensor,  # [R] int64 in [1, V] (V = no top-k)
    top_p: Tensor,  # [R] float32, >= 1 = no top-p
) -> Tensor:  # [R, V] float32, removed tokens set to -inf
    """Mask `scaled` to the top-k tokens, then to the top-p nucleus of what is left."""
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
    weights: Tensor,  # [R, V] non-negative, each row with a positive entry
    uniforms: Tensor,  # [R, V] uniform in [0, 1)
) -> Tensor:  # [R] int64
    """Draw one token per row with probability proportional to `weights` (exponential race:
    ``argmax(w / E)``, ``E = -log(1 - u)``). Deterministic given `uniforms`."""
    exp = (-torch.log1p(-uniforms.float())).clamp_min(torch.finfo(torch.float32).tiny)
    return (weights.float() / exp).argmax(dim=-1)


def derive_seed(seed: int, offset: int, stream: int) -> int:
    """A 64-bit generator seed from (request seed, output position, purpose): splitmix64 mixing,
    so neighbouring offsets and streams give unrelated generator states."""
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
    """The generator a seeded request draws from for (`offset`, `stream`)."""
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
    """`num` uniforms per row. A seeded row draws from ``request_generator(seed, offset,
    stream)``; the unseeded rows share one batched draw from `generator` (None = the process
    RNG of `device`)."""
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
) -> Tensor:  # [num, vocab] float32 uniform in [0, 1)
    """A seeded request's position noise at output positions ``first .. first + num - 1``: row
    j comes from ``request_generator(seed, first + j, STREAM_ACCEPT)`` alone, so it is the same
    whichever step, batch or draft length the position falls in."""
    return draw_uniforms(vocab, [seed] * num, range(first, first + num), STREAM_ACCEPT, device)


def sample_tokens(
    logits: Tensor,  # [R, V] raw logits
    sampling: SamplingTensors,
    offsets: Sequence[int],
    stream: int = STREAM_DRAFT,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:  # ([R] int64 tokens, [R, V] float32 processed probs)
    """Sample one token per row from its processed distribution (greedy rows: argmax, no
    randomness). Returns the tokens and the processed distributions; a draft worker passes the
    latter to acceptance as `draft_probs` (q)."""
    probs = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    tokens = logits.argmax(dim=-1)
    if not bool(sampling.greedy.all()):
        uniforms = draw_uniforms(
            probs.shape[-1], sampling.seeds, offsets, stream, logits.device, generator
        )
        tokens = torch.where(sampling.greedy, tokens, sample_from_weights(probs, uniforms))
    return tokens, probs


def compute_logprobs(logits: Tensor) -> Tensor:  # [..., V] raw logits -> [..., V] float32
    """Log-probabilities of the raw (unprocessed) logits: ``log_softmax`` in float32."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(
    logprobs: Tensor,  # [N, V] float32 log-probabilities
    token_ids: Tensor,  # [N] int64 in [0, V)
) -> Tensor:  # [N] float32
    """The log-probability of each row's token."""
    return logprobs.gather(-1, token_ids[:, None]).squeeze(-1)


def top_logprobs(
    logprobs: Tensor,  # [..., V] float32 log-probabilities
    num: int,
) -> tuple[Tensor, Tensor]:  # ([..., n] int64 ids, [..., n] float32 logprobs), n = min(num, V)
    """The `num` most likely tokens of every row, most likely first."""
    n = min(num, logprobs.shape[-1])
    values, ids = logprobs.topk(n, dim=-1)
    return ids, values
