"""Seeded tiny random Llama models for tests (no files, no downloads)."""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from pipeline.models.config import ModelConfig
from pipeline.models.llama import LlamaModel


def tiny_config(**overrides: object) -> ModelConfig:
    fields: dict[str, object] = {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 1024,
        "bos_token_id": 1, "eos_token_ids": [2],
    }
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def tiny_model(config: ModelConfig | None = None, seed: int = 0) -> LlamaModel:
    """Random weights from `seed`, scaled for peaked logits: greedy decoding then stays stable
    under small perturbations, unlike with a 0.02-std init."""
    config = config or tiny_config()
    gen = torch.Generator().manual_seed(seed)
    model = LlamaModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name == "embed.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        if model.lm_head is not None:
            model.lm_head.weight.mul_(4.0)
    return model.eval()


class DraftTargetPair(NamedTuple):
    target: LlamaModel
    draft: LlamaModel
    config: ModelConfig


def make_draft_target_pair(seed: int = 0, agreement_noise: float = 0.0,
                           config: ModelConfig | None = None) -> DraftTargetPair:
    """The draft is the target with `agreement_noise * std(weight) * N(0, 1)` added to every
    weight; greedy agreement on random inputs is about 90% at 0.02, 35% at 0.3, 5% at 1.0."""
    if agreement_noise < 0:
        raise ValueError(f"agreement_noise must be >= 0, got {agreement_noise}")
    target = tiny_model(config, seed)
    draft = copy.deepcopy(target)
    if agreement_noise > 0:
        gen = torch.Generator().manual_seed(seed + 1_000_003)
        with torch.no_grad():
            for p in draft.parameters():
                scale = p.std() if p.numel() > 1 else p.abs()
                p.add_(agreement_noise * scale * torch.randn(p.shape, generator=gen))
    return DraftTargetPair(target, draft, target.config)
