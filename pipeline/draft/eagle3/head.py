"""The EAGLE-3 head: `fc` fuses the target's aux hidden states (n_aux x H_target) to H; one Llama
decoder layer whose attention reads [norm(embedding), hidden_norm(hidden)] (2H); `norm`; an LM
head over the draft vocabulary, mapped to target ids by `d2t` (target = draft + d2t[draft])."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.config import ModelConfig
from pipeline.models.llama import MLP, RMSNorm, Rotary, apply_rope


@dataclass
class Eagle3Config:
    """`layer`: the decoder layer's dims; its `vocab_size` is the target vocabulary (the
    embedding's rows). `aux_layer_ids` None: the target's default (`default_aux_layers`)."""

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] | None = None
    num_aux: int = 3
    norm_before_residual: bool = False
    fc_bias: bool = False
    layout: str = "eagle"

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size


def default_aux_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


class HeadKV:
    """One request's head KV, contiguous and grown by doubling; rows at or past `length` are
    stale, so a rollback is a length update."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.k = torch.empty((16, kv_heads, head_dim), dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        need = self.length + k.shape[0]
        if need > self.k.shape[0]:
            size = max(need, 2 * self.k.shape[0])
            self.k = torch.cat([self.k[:self.length], self.k.new_empty((size - self.length,
                                                                         *self.k.shape[1:]))])
            self.v = torch.cat([self.v[:self.length], self.v.new_empty((size - self.length,
                                                                         *self.v.shape[1:]))])
        self.k[self.length:need] = k
        self.v[self.length:need] = v
        self.length = need

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"head KV: cannot truncate to {length}, it holds {self.length}")
        self.length = length


class HeadAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(2 * config.hidden_size, qkv_out, bias=config.attention_bias)
        self.wo = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                caches: list[HeadKV], counts: list[int]) -> torch.Tensor:
        n, h, kh, hd = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.wqkv(x).split([(h + kh) * hd, kh * hd], dim=-1)
        qk = apply_rope(qk.view(n, h + kh, hd), cos, sin)
        q, k = qk.split([h, kh], dim=1)
        v = v.view(n, kh, hd)
        out, start = [], 0
        for cache, count in zip(caches, counts):
            end = start + count
            cache.append(k[start:end], v[start:end])
            out.append(self._attend(q[start:end], cache))
            start = end
        return self.wo(torch.cat(out).reshape(n, h * hd))

    def _attend(self, q: torch.Tensor, cache: HeadKV) -> torch.Tensor:
        total, n = cache.length, q.shape[0]
        group = self.n_heads // self.n_kv_heads
        keys = cache.k[:total].repeat_interleave(group, dim=1).transpose(0, 1)
        values = cache.v[:total].repeat_interleave(group, dim=1).transpose(0, 1)
        # query j sits at position total - n + j and sees every row up to it
        mask = torch.arange(total, device=q.device)[None] <= \
            (total - n + torch.arange(n, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        return out.transpose(0, 1)


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        layer, hidden = config.layer, config.hidden_size
        eps = layer.rms_norm_eps
        self.embed = nn.Embedding(layer.vocab_size, hidden)
        self.fc = nn.Linear(config.num_aux * config.target_hidden_size, hidden,
                            bias=config.fc_bias)
        self.input_norm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.attn = HeadAttention(layer)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.mlp = MLP(layer)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(layer.vocab_size, dtype=torch.bool))
        self.rotary = Rotary(layer)
        self.aux_layer_ids: list[int] = list(config.aux_layer_ids or [])

    def new_cache(self) -> HeadKV:
        return HeadKV(self.attn.n_kv_heads, self.attn.head_dim, self.fc.weight.dtype,
                      self.fc.weight.device)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[n, n_aux * H_target] target aux hidden states -> [n, H]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, target_ids: torch.Tensor, hidden: torch.Tensor, caches: list[HeadKV],
                counts: list[int]) -> torch.Tensor:
        """Rows: counts[i] consecutive positions of request i (appended to caches[i]), each
        a token (target id) and the hidden state before it. Returns the pre-norm hidden
        states, which the next draft position takes as its hidden."""
        positions = torch.cat([torch.arange(c.length, c.length + n) for c, n in
                               zip(caches, counts)]).to(hidden.device)
        cos, sin = self.rotary.lookup(positions, hidden.dtype)
        x, residual = self.layer_input(target_ids, hidden)
        x = residual + self.attn(x, cos, sin, caches, counts)
        return x + self.mlp(self.mlp_norm(x))

    def layer_input(self, target_ids: torch.Tensor, hidden: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer's 2H input (token embedding and hidden state, each normed) and
        the residual it adds to."""
        embeds = self.input_norm(self.embed(target_ids))
        if self.config.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        return torch.cat([embeds, hidden], dim=-1), residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def to_target_vocab(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """[..., draft_vocab] -> [..., target vocab], zero where the draft vocabulary has no
        entry (a draft distribution q for rejection sampling)."""
        out = draft_probs.new_zeros((*draft_probs.shape[:-1], self.config.vocab_size))
        ids = self.to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        out[..., ids] = draft_probs
        return out
