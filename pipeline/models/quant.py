"""4-bit weights on torch's CPU int4 kernel: GGUF Q4_0 / Q4_1 / Q4_K, or float weights quantized
at load. All three formats are `w = d * q + m` per 32 weights, held exactly by `GroupQuant`;
codes stay unpacked until the first forward so fusing and TP sharding slice them like floats."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

GROUP = 32  # weights per scale: the block of Q4_0/Q4_1 and the sub-block of Q4_K
COMPUTE_DTYPE = torch.bfloat16  # the kernel's fast input dtype on CPU


@dataclass
class GroupQuant:
    """A weight [N, K] as `codes * scale + offset` (uint8 codes, float32 [N, K // GROUP])."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale.repeat_interleave(GROUP, 1) + \
            self.offset.repeat_interleave(GROUP, 1)

    def rows(self, index: slice | torch.Tensor) -> GroupQuant:
        return GroupQuant(self.codes[index], self.scale[index], self.offset[index])

    def columns(self, start: int, end: int) -> GroupQuant:
        if start % GROUP or end % GROUP:
            raise ValueError(f"4-bit weights split along K only at multiples of {GROUP}, "
                             f"got columns {start}:{end}")
        g = slice(start // GROUP, end // GROUP)
        return GroupQuant(self.codes[:, start:end], self.scale[:, g], self.offset[:, g])

    @staticmethod
    def cat(parts: list[GroupQuant]) -> GroupQuant:
        return GroupQuant(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.offset for p in parts]))


@dataclass
class Int8Rows:
    """A float32 table [V, H] as int8 codes and a float32 scale per GROUP values, made only where
    that holds it exactly (a table dequantized from GGUF's Q8_0): a quarter of the bytes."""

    codes: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def exact(w: torch.Tensor, chunk: int = 8192) -> Int8Rows | None:
        v, h = w.shape
        if h % GROUP or w.dtype != torch.float32:
            return None
        codes = torch.empty(v, h, dtype=torch.int8)
        scale = torch.empty(v, h // GROUP)
        for start in range(0, v, chunk):
            g = w[start:start + chunk].reshape(-1, h // GROUP, GROUP)
            s = g.abs().amax(-1) / 127
            q = (g / torch.where(s > 0, s, torch.ones_like(s))[..., None]).round()
            if q.abs().max() > 127 or not torch.equal(q * s[..., None], g):
                return None
            codes[start:start + chunk] = q.reshape(-1, h).to(torch.int8)
            scale[start:start + chunk] = s
        return Int8Rows(codes, scale)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        codes = self.codes[index].float().unflatten(-1, (-1, GROUP))
        return (codes * self.scale[index][..., None]).flatten(-2)


def quantize_float(w: torch.Tensor) -> GroupQuant:
    """Round-to-nearest min/max (Q4_1's scheme)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"4-bit quantization needs in_features divisible by {GROUP}, got {k}")
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8)
    return GroupQuant(codes.reshape(n, k), scale, lo)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def gguf_group_quant(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> GroupQuant:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import Q4_K

    n, k = shape
    blocks = np.ascontiguousarray(raw).reshape(n, -1).view(np.uint8)
    if qtype in (Q.Q4_0, Q.Q4_1):
        blocks = blocks.reshape(n, k // GROUP, -1)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if qtype == Q.Q4_0:  # w = d * (q - 8)
            m, qs = -8 * d, blocks[..., 2:]
        else:
            m, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), \
                blocks[..., 4:]
        codes = _nibbles(qs, GROUP)
    elif qtype == Q.Q4_K:    # 256-weight super-blocks of 8 sub-blocks: w = d*sc*q - dmin*mn
        blocks = blocks.reshape(n * (k // 256), -1)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        d, m = d * sc.astype(np.float32), -dmin * mn.astype(np.float32)
        qs = blocks[:, 16:].reshape(-1, 4, 32)
        codes = _nibbles(qs, 64).reshape(-1, 8, GROUP)
    else:
        raise ValueError(f"not a 4-bit group format: {Q(qtype).name}")
    return GroupQuant(torch.from_numpy(np.ascontiguousarray(codes).reshape(n, k)),
                      torch.from_numpy(np.ascontiguousarray(d).reshape(n, k // GROUP)),
                      torch.from_numpy(np.ascontiguousarray(m).reshape(n, k // GROUP)))


class Int4Linear(nn.Module):
    """bfloat16 inside, the caller's dtype in and out."""

    def __init__(self, weight: GroupQuant, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight: GroupQuant | None = weight
        self.bias = None if bias is None else \
            nn.Parameter(bias.detach().to(COMPUTE_DTYPE), requires_grad=False)
        # Not buffers: `Module.to(dtype)` must not widen the kernel's bfloat16 scales.
        self.packed: torch.Tensor | None = None
        self.scales_zeros: torch.Tensor | None = None

    def pack(self) -> None:
        w = self.weight
        if w is None:
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32), 1)
        zero = w.offset + 8 * w.scale  # the kernel reads (q - 8) * scale + zero
        self.scales_zeros = torch.stack([w.scale.t(), zero.t()], dim=-1).to(COMPUTE_DTYPE) \
            .contiguous()
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            self.pack()
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # a decode: no reshapes
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat.to(COMPUTE_DTYPE), self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4/{GROUP}"


def pack_quantized(model: nn.Module) -> None:
    """After TP sharding, before serving: keeps the first step fast."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.pack()


def quantize_linears(model: nn.Module) -> None:
    """`quantization: int4`: every projection inside `model.layers` becomes an Int4Linear; the
    embedding and LM head keep their precision (as llama.cpp's Q4_K_M does)."""
    found = [(parent, name, child) for parent in model.layers.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, linear in found:
        setattr(parent, name, Int4Linear(quantize_float(linear.weight), linear.bias))


__all__ = ["COMPUTE_DTYPE", "GROUP", "GroupQuant", "Int4Linear", "Int8Rows",
           "gguf_group_quant", "pack_quantized", "quantize_float", "quantize_linears"]
