"""The references tests compare against: plain target-only greedy decoding, one token per forward
(the yardstick for speculative output; deliberately shares no code with the engine loop), and a
chi-square goodness-of-fit p-value for the samplers' distribution tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeline.config import load_config
from pipeline.models.runner import ModelRunner
from pipeline.models.runners import build_runner


def greedy_reference(runner: ModelRunner, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """The first `num_tokens` greedy tokens after `prompt_ids` (no stop rules)."""
    slot = runner.allocate()
    try:
        logits = runner.forward([slot], [list(prompt_ids)], last_only=True)[0]
        out = [int(logits[-1].argmax())]
        while len(out) < num_tokens:
            logits = runner.forward([slot], [[out[-1]]])[0]
            out.append(int(logits[-1].argmax()))
        return out
    finally:
        runner.free(slot)


def target_references(config_path: str, prompts: Sequence[list[int]], num_tokens: int,
                      overrides: dict[str, Any] | None = None) -> list[list[int]]:
    """`greedy_reference` of each prompt on the target `config_path` (+ `overrides`) names."""
    runner = build_runner(load_config(config_path, {**(overrides or {}), "draft": "none"}))
    return [greedy_reference(runner, list(p), num_tokens) for p in prompts]


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of `counts` [V] to `probs` [V]; 0 if a token of
    probability 0 was seen. p-value = upper regularised incomplete gamma (no scipy needed)."""
    counts, probs = counts.double(), probs.double()
    support = probs > 0
    if bool((counts[~support] > 0).any()):
        return 0.0
    expected = probs[support] / probs[support].sum() * counts.sum()
    assert float(expected.min()) >= 5, "test design: expected counts too small for chi-square"
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(int(support.sum()) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))
