"""The null model (`model: null:<forward_ms>`): a free forward, or a fixed sleep standing in for
an accelerator's, so a benchmark sees only what the engine adds to a step. Its next token is
`next_token` of the current one, never end-of-sequence: every request runs to `max_tokens`."""

from __future__ import annotations

import time

import torch

from pipeline.models.config import ModelConfig
from pipeline.models.tiny import tiny_config


def null_config() -> ModelConfig:
    return tiny_config(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, hidden_size=8,
                       intermediate_size=8)


def next_token(token: int, vocab_size: int, eos_token_ids: list[int]) -> int:
    nxt = (token + 1) % vocab_size
    while nxt in eos_token_ids:
        nxt = (nxt + 1) % vocab_size
    return nxt


class NullModel(torch.nn.Module):
    def __init__(self, config: ModelConfig, forward_ms: float = 0.0) -> None:
        super().__init__()
        self.config = config
        self.forward_s = forward_ms / 1000.0
        vocab = config.vocab_size
        successors = [next_token(t, vocab, config.eos_token_ids) for t in range(vocab)]
        table = torch.full((vocab, vocab), -10.0)
        table[torch.arange(vocab), torch.tensor(successors)] = 10.0
        self.register_buffer("table", table)

    @property
    def local_kv_heads(self) -> int:
        return self.config.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: object,
                attn_metadata: object, logits_idx: torch.Tensor | None = None) -> torch.Tensor:
        if self.forward_s > 0:
            time.sleep(self.forward_s)
        ids = input_ids if logits_idx is None else input_ids[logits_idx]
        return self.table[ids]
