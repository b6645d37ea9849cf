"""Llama-family causal LM for serving (SmolLM2, Llama 2/3, Qwen2). One forward takes the flat
new tokens of every request (prefills, verify runs, decodes mixed). Tensor parallelism is
applied from outside (`pipeline.models.tp.apply_tp`). `wqkv` and `w_gate_up` fuse projections:
kernel launches are most of a small model's decode time."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.attention import AttnMetadata, attend, write_kv
from pipeline.models.config import ModelConfig
from pipeline.models.kv_cache import KVCache
from pipeline.models.quant import Int8Rows


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
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
    """cos/sin [max_pos, head_dim] in HF's `rotate_half` layout, grown on use."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = rope_inv_freq(config)
        self.cos = torch.empty(0, device="cpu")
        self.sin = torch.empty(0, device="cpu")

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
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
        # As HF does: normalise in float32, scale in the model dtype.
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
        qk = apply_rope(qk.view(n, h + kh, hd), cos, sin)
        q, k = qk.split([h, kh], dim=1)
        write_kv(k_cache, v_cache, k, v.view(n, kh, hd), meta)
        return self.wo(attend(q, k_cache, v_cache, meta, self.scale))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
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
    """`lm_head` is None when embeddings are tied."""

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
                attn_metadata: AttnMetadata, logits_idx: torch.Tensor | None = None,
                aux_layers: list[int] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `aux_layers`: (logits, [tokens, len(aux_layers) * H]), the residual stream
        entering each of those layers (EAGLE-3's aux hidden states), every token's row."""
        x = self.embed(input_ids)
        cos, sin = self.rotary.lookup(positions, x.dtype)
        entering = {}
        for i, layer in enumerate(self.layers):
            if aux_layers and i in aux_layers:
                entering[i] = x
            x = layer(x, cos, sin, kv_cache.k[i], kv_cache.v[i], attn_metadata)
        if logits_idx is not None:
            x = x[logits_idx]
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight) if self.lm_head is None else self.lm_head(x)
        if aux_layers:
            return logits, torch.cat([entering[i] for i in aux_layers], dim=-1)
        return logits


class CpuLinear(nn.Module):
    """CPU float32 projection, two copies of the weight: one row runs MKL's GEMV on a
    column-major weight; more rows run oneDNN on a weight packed once, since MKL's small-M
    SGEMM repacks on every call. 2 rows run as 3: oneDNN's 2-row kernel is slower."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=False)
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 8)
        # oneDNN gives a row the same bits at any row count, MKL's GEMV other bits than oneDNN:
        # the batch-invariant path (pipeline.models.attention) runs every row count on oneDNN.
        self.row_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant and x.dim() == 2:
            return self._onednn(x)
        if x.dim() != 2 or x.shape[0] == 1:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 2:
            return self._onednn(torch.cat([x, x[-1:]]))[:2]
        return self._onednn(x)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


class RescoredHead(nn.Module):
    """CPU float32 LM head for 4-bit models: a oneDNN bfloat16 GEMM (half a float32 one's bytes,
    row-invariant), then each row's `CANDIDATES` top logits recomputed in float32 from the
    row-major weight the embedding shares (bfloat16's 2^-8 steps tie the top tokens). A table
    int8 codes hold exactly (Q8_0's) is kept as them, not as float32 (`table`)."""

    CANDIDATES = 64

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 8)
        self.table = Int8Rows.exact(w)
        self.weight = nn.Parameter(w, requires_grad=False) if self.table is None else None

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.weight[index] if self.table is None else self.table.rows(index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        logits = torch.ops.mkldnn._linear_pointwise(
            rows.to(torch.bfloat16), self.packed, None, "none", [None], "").float()
        top = logits.topk(min(self.CANDIDATES, logits.shape[-1]), dim=-1, sorted=False).indices
        # a product and a sum per candidate: a row's sum runs alike in any batch
        exact = (self.rows(top) * rows[:, None, :]).sum(-1)
        return logits.scatter_(1, top, exact).reshape(*lead, -1)


class TableEmbedding(nn.Module):
    """The input embedding over a tied RescoredHead's int8 table: the same float32 rows."""

    def __init__(self, table: Int8Rows) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)

    @property
    def weight(self) -> torch.Tensor:
        return self.table.rows(torch.arange(self.table.codes.shape[0]))


def use_rescored_head(model: LlamaModel) -> None:
    """Before `use_column_major_weights` (which then leaves the head alone): a float LM head
    becomes a `RescoredHead`; a tied one shares the embedding's row-major table. Idempotent."""
    tied = model.lm_head is None
    if not (tied or type(model.lm_head) is nn.Linear) or not _onednn_linear_available():
        return  # already rescored, or a 4-bit head (a file's Q4 output.weight)
    with torch.no_grad():
        model.lm_head = head = RescoredHead(model.embed.weight if tied else model.lm_head.weight)
        if tied and head.table is not None:
            model.embed = TableEmbedding(head.table)
        elif tied:
            model.embed.weight = head.weight


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and \
        hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def use_column_major_weights(model: LlamaModel) -> None:
    """CPU float32 only: every projection column-major (a no-transpose GEMM) or, with oneDNN, a
    `CpuLinear`. A tied LM head shares its column-major tensor with the embedding (one copy).
    Idempotent."""
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
