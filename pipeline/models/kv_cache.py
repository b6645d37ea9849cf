"""Block-paged KV cache: per layer `k`, `v` [num_blocks, block_size, kv_heads, head_dim], one
pool sized once. A sequence ("slot", at most `num_slots`) owns a block table; its token i is at
row i % block_size of block table[i // block_size]. Rows at or past `lengths[slot]` are stale
and never attended, so rollback is a length update. Allocation is deterministic (lowest free
slot, first freed block): tensor-parallel ranks making the same calls hold the same ids."""

from __future__ import annotations

import bisect
import hashlib
from array import array

import torch

from pipeline.models.block_manager import BlockManager, CacheFullError

__all__ = ["DEFAULT_BLOCK_SIZE", "CacheFullError", "KVCache"]

DEFAULT_BLOCK_SIZE = 16  # a multiple of vllm-flash-attn's FLASH_PAGE_MULTIPLE


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", block_size: int = DEFAULT_BLOCK_SIZE,
                 num_blocks: int | None = None, prefix_caching: bool = False) -> None:
        if num_slots <= 0 or max_len <= 0 or block_size <= 0:
            raise ValueError(f"KVCache needs num_slots, max_len and block_size > 0, "
                             f"got {num_slots}, {max_len}, {block_size}")
        self.num_slots = num_slots
        self.max_len = max_len
        self.block_size = block_size
        if num_blocks is None:
            num_blocks = num_slots * -(-max_len // block_size)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_slots
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self._free = list(range(num_slots))  # sorted
        self._owned = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"KV cache full: all {self.num_slots} slots are in use")
        slot = self._free.pop(0)
        self._owned[slot] = True
        self.lengths[slot] = 0
        self.tokens[slot] = []
        self.blocks.add(slot)
        return slot

    def attach_prefix(self, slot: int, tokens: list[int]) -> int:
        """A fresh slot takes the longest cached prefix of `tokens` in whole blocks, short of
        the last token (computed for its logits); returns the prefix's length."""
        self.check_owned(slot)
        if self.lengths[slot]:
            raise ValueError(f"attach_prefix: KV slot {slot} is not empty")
        n = self.blocks.attach(slot, tokens, len(tokens) - 1)
        self.lengths[slot] = n
        self.tokens[slot] = list(tokens[:n])
        return n

    def free(self, slot: int) -> None:
        self.check_owned(slot)
        self._owned[slot] = False
        self.lengths[slot] = 0
        self.blocks.remove(slot)
        bisect.insort(self._free, slot)

    def check_owned(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"unknown KV slot {slot!r} (have 0..{self.num_slots - 1})")
        if not self._owned[slot]:
            raise ValueError(f"KV slot {slot} is free (not allocated)")

    def table(self, slot: int) -> list[int]:
        return self.blocks.tables[slot]

    def digest(self) -> bytes:
        """16 bytes over the block manager's decision history and free counts: tensor-parallel
        ranks compare it every step, and ranks that ever decided differently never match."""
        free = array("q", (self.blocks.num_free, self.blocks.num_cached_free)).tobytes()
        return hashlib.blake2b(self.blocks.history + free, digest_size=16).digest()

    def reserve(self, slots: list[int], num_tokens: list[int]) -> None:
        """All or nothing (CacheFullError)."""
        need = sum(self.blocks.missing(s, n) for s, n in zip(slots, num_tokens))
        if need > self.blocks.num_free:
            raise CacheFullError(f"KV cache full: {need} more blocks needed, "
                                 f"{self.blocks.num_free} of {self.num_blocks} free")
        for slot, n in zip(slots, num_tokens):
            self.blocks.ensure(slot, n)

    def truncate(self, slot: int, length: int) -> None:
        """Roll back to `length` tokens, freeing blocks wholly past it. The caller vouches that
        those tokens are committed, never drafts: their full blocks become cacheable."""
        self.check_owned(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"truncate slot {slot} to {length}: must be in "
                             f"0..{self.lengths[slot]} (current length)")
        self.lengths[slot] = length
        del self.tokens[slot][length:]
        self.blocks.truncate(slot, length)
        self.blocks.commit(slot, self.tokens[slot])
