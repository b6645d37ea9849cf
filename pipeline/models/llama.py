"""Llama-family causal LM written for serving (SmolLM2, Llama 2/3, Qwen2).

Read bottom-up: RoPE, RMSNorm, attention, MLP, block, model. Tokens are flat: one
forward takes every new token of every request in the batch (a long prefill, a k+1 verify
run and 1-token decodes mixed), with positions, the KV cache and the attention metadata
passed in explicitly. No torch.distributed here: tensor parallelism is applied from the
outside by `pipeline.models.tp.apply_tp`, which shards the projections and adds the
all-reduce after the row-parallel ones.

Fused projections: `wqkv` = [q; k; v] rows and `w_gate_up` = [gate; up] rows, one matmul
each (fewer kernel launches per token, which is most of a small model's decode time).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.attention import AttnMetadata, attend, write_kv
from pipeline.models.config import ModelConfig
from pipeline.models.kv_cache import KVCache


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies, with Llama-3 scaling when configured."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv
    factor = float(rs["factor"])
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_len = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos/sin table [max_pos, head_dim] (halves repeated, HF `rotate_half` layout), grown on use."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = rope_inv_freq(config)
        self.cos = torch.empty(0, device="cpu")
        self.sin = torch.empty(0, device="cpu")

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [N] -> cos, sin [N, 1, head_dim] in `dtype`."""
        need = int(positions.max()) + 1
        if self.cos.shape[0] < need or self.cos.device != positions.device or \
                self.cos.dtype != dtype:
            size = max(need, 2 * self.cos.shape[0], 2048)
            freqs = torch.outer(torch.arange(size, dtype=torch.float32, device="cpu"), self.inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            self.cos = emb.cos().to(dtype=dtype, device=positions.device)
            self.sin = emb.sin().to(dtype=dtype, device=positions.device)
        return self.cos[positions][:, None], self.sin[positions][:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos, sin [N, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Half precision: normalise in float32, scale in the model dtype (as HF does).
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Head counts are per rank: apply_tp divides them.
        self.n_heads = config.num_heads
        self.n_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, qkv_out, bias=config.attention_bias)
        self.wo = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        n, h, kh, hd = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.wqkv(x).split([(h + kh) * hd, kh * hd], dim=-1)
        qk = apply_rope(qk.view(n, h + kh, hd), cos, sin)  # q and k heads in one pass
        q, k = qk.split([h, kh], dim=1)
        write_kv(k_cache, v_cache, k, v.view(n, kh, hd), meta)
        return self.wo(attend(q, k_cache, v_cache, meta, self.scale))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size  # per rank after apply_tp
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.intermediate, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    """Decoder + LM head. `lm_head` is None when embeddings are tied (reads `embed.weight`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else \
            nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config)

    @property
    def local_kv_heads(self) -> int:
        return self.layers[0].attn.n_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttnMetadata, logits_idx: torch.Tensor | None = None
                ) -> torch.Tensor:
        """input_ids, positions [N] -> logits [N, vocab] (or [len(logits_idx), vocab])."""
        x = self.embed(input_ids)
        cos, sin = self.rotary.lookup(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache.k[i], kv_cache.v[i], attn_metadata)
        if logits_idx is not None:
            x = x[logits_idx]
        x = self.norm(x)
        if self.lm_head is None:
            return F.linear(x, self.embed.weight)
        return self.lm_head(x)


class CpuLinear(nn.Module):
    """CPU float32 projection with two weight layouts, picked per call by the row count.

    One row (a batch-1 decode) is a GEMV: MKL on a column-major weight ([out, in] shape,
    [in, out] memory) is fastest. Two or more rows (verify runs, batched decode, prefill):
    MKL's small-M SGEMM repacks the weight on every call, so a oneDNN weight packed once is
    used instead. Measured single-threaded, SmolLM2 shapes streamed from memory (every layer
    plus the LM head): 2 rows 60 vs 72 ms, 5 rows 61 vs 94 ms, 8 rows 73 vs 109 ms, 160 rows
    393 vs 447 ms; 1 row 44 ms MKL vs 58 ms oneDNN. The price is a second copy of the weights.
    A 2-row call runs as 3 rows (the last repeated, then dropped): oneDNN's 2-row kernel is
    slower than its 3-row one here (SmolLM2 forward, 2 rows: 73-76 ms plain, 53-61 ms padded;
    3 rows 54-57 ms), and 2 rows is a one-draft verify at batch 1.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=False)
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] == 1:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 2:
            return self._onednn(torch.cat([x, x[-1:]]))[:2]
        return self._onednn(x)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and \
        hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def use_column_major_weights(model: LlamaModel) -> None:
    """CPU float32 only: store every projection's weight column-major ([out, in] shape, [in, out]
    memory), so `F.linear` runs a no-transpose GEMM. Measured single-threaded on SmolLM2 shapes
    this is never slower and 1.5-2.2x faster for 5-32 rows (verify runs, batched decode);
    bfloat16 GEMMs (oneDNN) prefer the usual layout, so they are left alone. A tied LM head
    becomes column-major too, and the embedding looks its rows up in that same tensor (one
    float32 copy of the table, not two).
    Where oneDNN is available every projection becomes a `CpuLinear` (multi-row calls on a
    prepacked oneDNN weight). Idempotent: modules shared with another model are kept."""
    with torch.no_grad():
        if model.lm_head is None:
            w = model.embed.weight
            model.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            model.lm_head.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=False)
            model.embed.weight = model.lm_head.weight
        linears = [(parent, name, child) for parent in model.modules()
                   for name, child in parent.named_children() if type(child) is nn.Linear]
        for parent, name, linear in linears:
            if _onednn_linear_available():
                setattr(parent, name, CpuLinear(linear))
            else:
                linear.weight = nn.Parameter(linear.weight.t().contiguous().t(),
                                             requires_grad=False)
