"""The distributions the losslessness checks draw from: a target over V tokens, near and far
drafts, and a batch of N rows per case; `lossless_pvalues` tests generated tokens against the
processed target. Shared by the acceptance tests and the grammar-masked acceptance test."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.params import SamplingParams
from pipeline.sampling import SamplingTensors, process_logits
from support.reference_decode import chi2_pvalue

V = 6
P = [
    [0.30, 0.25, 0.20, 0.15, 0.07, 0.03],
    [0.05, 0.10, 0.40, 0.25, 0.10, 0.10],
    [0.20, 0.05, 0.05, 0.30, 0.10, 0.30],
]
Q_NEAR = [[0.25, 0.30, 0.15, 0.20, 0.05, 0.05], [0.10, 0.10, 0.30, 0.30, 0.10, 0.10]]
Q_FAR = [[0.01, 0.02, 0.02, 0.05, 0.40, 0.50], [0.60, 0.0, 0.0, 0.0, 0.0, 0.40]]
N = 40_000


@dataclass
class Case:
    target: list[list[float]]  # [3, V] probabilities; logits are their logs
    draft: list[list[float]] | None  # [2, V] draft distribution, None = n-gram point mass
    ngram_drafts: tuple[int, int] = (1, 4)
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


CASES = {
    "q_near": Case(P, Q_NEAR),
    "q_far": Case(P, Q_FAR),
    "point_mass": Case(P, None),
    "point_mass_unlikely_draft": Case(P, None, ngram_drafts=(4, 0)),
    "top_k_top_p_model_draft": Case(P, Q_NEAR, temperature=0.7, top_k=4, top_p=0.9),
    "top_k_top_p_point_mass": Case(
        P, None, ngram_drafts=(3, 2), temperature=1.3, top_k=5, top_p=0.85
    ),
}


def logits_of(probs: list[list[float]]) -> torch.Tensor:  # [n, V] logits, -inf where probability 0
    return torch.tensor(probs, dtype=torch.float64).log().float()


def make_batch(case: Case, gen: torch.Generator):
    """N rows of one case: raw target logits [N, 3, V], processed p [3, V], draft probs
    [N, 2, V] | None, drafts [N, 2], num_drafts [N] cycling 0, 1, 2, 2."""
    sampling = SamplingTensors.from_params(
        [SamplingParams(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p)] * 3
    )
    p = process_logits(logits_of(case.target), sampling.temperature, sampling.top_k, sampling.top_p)
    if case.draft is None:
        q = None
        drafts = torch.tensor(case.ngram_drafts).expand(N, -1)
    else:
        # the draft model applies the same temperature / top-k / top-p to its own logits
        q = process_logits(
            logits_of(case.draft), sampling.temperature[:2], sampling.top_k[:2], sampling.top_p[:2]
        )
        drafts = torch.stack(
            [torch.multinomial(q[j], N, replacement=True, generator=gen) for j in range(2)], 1
        )
        q = q.expand(N, -1, -1)
    num_drafts = (torch.arange(N) % 4).clamp(max=2)
    return logits_of(case.target).expand(N, -1, -1), p, q, drafts, num_drafts


def lossless_pvalues(
    tokens: torch.Tensor,  # [N, 3]
    num_tokens: torch.Tensor,  # [N]
    p: torch.Tensor,  # [3, V] processed target distributions
) -> list[float]:
    """p-values of: the first token ~ p[0]; the second token, where the first was an accepted
    draft, ~ p[1]; the third ~ p[2] (positions with fewer than 1000 samples are skipped)."""
    out = []
    for j in range(3):
        rows = num_tokens > j
        if int(rows.sum()) >= 1000:
            out.append(chi2_pvalue(torch.bincount(tokens[rows, j], minlength=V), p[j]))
    return out
