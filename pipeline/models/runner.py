"""ModelRunner: one model replica (or tensor-parallel rank) and its block-paged KV cache;
`forward(slots, runs)` appends run i to slot i in one batched model call. TP ranks call the
same methods with the same arguments in lockstep, so they hold the same slot and block ids."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from pipeline.models.attention import FLASH_PAGE_MULTIPLE, build_metadata, resolve_backend
from pipeline.models.config import ModelConfig
from pipeline.models.kv_cache import DEFAULT_BLOCK_SIZE, CacheFullError, KVCache
from pipeline.models.llama import CpuLinear, use_column_major_weights, use_rescored_head
from pipeline.models.quant import Int4Linear, pack_quantized

__all__ = ["CacheFullError", "ModelRunner"]

INVARIANT_SETTINGS = ("auto", "on", "off")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_slots: int, max_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 backend: str = "auto", block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_cache_tokens: int | None = None, prefix_caching: bool = False,
                 attention_invariant: str = "auto") -> None:
        """`kv_cache_tokens`: the pool's size, rounded up to whole blocks (None: num_slots x
        max_len). `attention_invariant`: see `resolve_invariant`."""
        self.config = config
        self.num_slots = num_slots
        self.max_len = max_len
        self.vocab_size = config.vocab_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.backend = resolve_backend(backend, self.device, dtype)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        if self.device.type == "cpu" and dtype == torch.float32 and hasattr(self.model, "layers"):
            if any(isinstance(m, Int4Linear) for m in self.model.modules()):
                use_rescored_head(self.model)
            use_column_major_weights(self.model)
        pack_quantized(self.model)
        self.invariant = resolve_invariant(attention_invariant, self.model, self.device,
                                           dtype, self.backend)
        # query heads per KV head; None: the faster, batch-dependent attention
        self.invariant_group = config.num_heads // config.num_kv_heads if self.invariant else None
        if self.invariant:
            for module in self.model.modules():
                if isinstance(module, CpuLinear):
                    module.row_invariant = True
        self.tokenizer = None
        self.chat_template: str | None = None
        if self.backend == "flash" and block_size % FLASH_PAGE_MULTIPLE:
            raise ValueError(f"block_size: attention backend 'flash' needs a multiple of "
                             f"{FLASH_PAGE_MULTIPLE}, got {block_size}")
        num_blocks = None if kv_cache_tokens is None else -(-kv_cache_tokens // block_size)
        self.cache = KVCache(
            num_layers=config.num_layers, num_slots=num_slots, max_len=max_len,
            num_kv_heads=model.local_kv_heads, head_dim=config.head_dim, dtype=dtype,
            device=self.device, block_size=block_size, num_blocks=num_blocks,
            prefix_caching=prefix_caching,
        )

    def allocate(self) -> int:
        return self.cache.allocate()

    def free(self, slot: int) -> None:
        self.cache.free(slot)

    def num_free(self) -> int:
        return self.cache.num_free

    def num_free_blocks(self) -> int:
        return self.cache.blocks.num_free

    def attach_prefix(self, slot: int, tokens: list[int]) -> int:
        """Returns n, the cached prefix's length (0 with caching off): feed only `tokens[n:]`."""
        return self.cache.attach_prefix(slot, tokens)

    def length(self, slot: int) -> int:
        self.cache.check_owned(slot)
        return self.cache.lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        """Roll back; the first `length` tokens must be committed (their blocks get cached)."""
        self.cache.truncate(slot, length)

    def forward(self, slots: list[int], runs: list[list[int]],
                last_only: bool | list[bool] = False, packed: bool = False,
                aux_layers: list[int] | None = None) -> Any:
        """Append run i at slot i's length; per-run float32 logits [len(run), vocab]. `last_only`
        (one flag or one per run): only the run's last row, skipping the LM head for the rest.
        `packed`: one stacked [N, vocab] tensor instead of a list. With `aux_layers` (a Llama
        model): (logits, every token's aux hidden states [sum(len(run)), n_aux * H])."""
        starts = self._validate(slots, runs)
        q_lens = [len(r) for r in runs]
        flags = [last_only] * len(runs) if isinstance(last_only, bool) else list(last_only)
        if len(flags) != len(runs):
            raise ValueError(f"forward: {len(flags)} last_only flags for {len(runs)} runs")
        # numpy: torch's min/max and tensor-from-list cost more per call
        ids = np.fromiter(itertools.chain.from_iterable(runs), dtype=np.int64, count=sum(q_lens))
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} out of vocabulary [0, {self.vocab_size})")
        self.cache.reserve(slots, [s + n for s, n in zip(starts, q_lens)])
        meta = build_metadata(self.backend, [self.cache.table(s) for s in slots], starts,
                              q_lens, self.cache.block_size, self.device, self.invariant_group)
        out_lens = [1 if f else n for f, n in zip(flags, q_lens)]
        logits_idx = None
        if any(flags):
            ends = list(itertools.accumulate(q_lens))
            rows = [range(e - o, e) for e, o in zip(ends, out_lens)]
            logits_idx = torch.tensor([i for r in rows for i in r], device=self.device)
        extra = {"aux_layers": aux_layers} if aux_layers else {}
        with torch.inference_mode():
            out = self.model(torch.from_numpy(ids).to(self.device), meta.positions,
                             self.cache, meta, logits_idx=logits_idx, **extra)
        logits, aux = out if aux_layers else (out, None)
        logits = logits.float()
        lengths, tokens = self.cache.lengths, self.cache.tokens
        for slot, run in zip(slots, runs):
            lengths[slot] += len(run)
            tokens[slot].extend(run)
        logits = logits if packed else list(logits.split(out_lens))
        return (logits, aux) if aux_layers else logits

    def _validate(self, slots: list[int], runs: list[list[int]]) -> list[int]:
        if len(slots) != len(runs):
            raise ValueError(f"forward: {len(slots)} slots but {len(runs)} runs")
        if not slots:
            raise ValueError("forward: empty batch")
        if len(set(slots)) != len(slots):
            raise ValueError(f"forward: a slot appears twice in {slots}")
        starts = []
        for slot, run in zip(slots, runs):
            self.cache.check_owned(slot)
            if len(run) == 0:
                raise ValueError(f"forward: empty run for slot {slot}")
            start = self.cache.lengths[slot]
            if start + len(run) > self.max_len:
                raise ValueError(f"forward: slot {slot} would hold {start + len(run)} tokens, "
                                 f"over max_len {self.max_len}")
            starts.append(start)
        return starts


def resolve_invariant(setting: str, model: torch.nn.Module, device: torch.device,
                      dtype: torch.dtype, backend: str) -> bool:
    """Whether a row's logits must not depend on the rest of its forward. "auto": on where the
    model has 4-bit projections on the CPU in float32: their kernel rounds its input to bfloat16,
    which turns the batch-dependent attention's last-bit differences into logit differences that
    break speculative == target only at near-ties (docs/quantized-weights.md)."""
    if setting not in INVARIANT_SETTINGS:
        raise ValueError(f"attention_invariant must be one of {INVARIANT_SETTINGS}, "
                         f"got {setting!r}")
    cpu32 = device.type == "cpu" and dtype == torch.float32 and backend == "sdpa"
    if setting == "on" and not cpu32:
        raise ValueError("attention_invariant: on needs the sdpa backend on the CPU in float32 "
                         f"(device {device}, dtype {dtype}, backend {backend})")
    if setting == "auto":
        return cpu32 and any(isinstance(m, Int4Linear) for m in model.modules())
    return setting == "on"
