"""Preallocated slot KV cache.

Layout per layer: `k[layer]`, `v[layer]` of shape [num_slots, capacity, kv_heads, head_dim].

Why slots and not pages: a speculative-decoding server keeps few requests per replica
(batch 1..64) and needs cheap rollback. With one contiguous row per request, rejecting
drafts is a length update (`truncate`), never a copy or a block free, and gathering a
request's KV is a slice. The price is memory reserved up to `max_len` per slot; paged
blocks would let short requests share that memory, which matters only at large batch.

Invariants:
- A slot is either free or owned by exactly one request (the caller of `allocate`).
- `lengths[slot]` is the number of committed tokens; positions >= length hold stale data
  that is never attended to (attention masks by length) and is overwritten on the next write.
- Only the owner frees its slot; freeing resets its length to 0.
"""

from __future__ import annotations

import bisect

import torch


class CacheFullError(RuntimeError):
    """Raised by `allocate` when every slot is owned."""


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", capacity_multiple: int = 1) -> None:
        if num_slots <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs num_slots > 0 and max_len > 0, "
                             f"got {num_slots}, {max_len}")
        self.num_slots = num_slots
        self.max_len = max_len
        # Flash-attention reads the cache as pages of `capacity` tokens; it wants a multiple of 16.
        self.capacity = -(-max_len // capacity_multiple) * capacity_multiple
        shape = (num_slots, self.capacity, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots))  # sorted: lowest slot first keeps batches contiguous
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
        return slot

    def free(self, slot: int) -> None:
        self.check_owned(slot)
        self._owned[slot] = False
        self.lengths[slot] = 0
        bisect.insort(self._free, slot)

    def check_owned(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"unknown KV slot {slot!r} (have 0..{self.num_slots - 1})")
        if not self._owned[slot]:
            raise ValueError(f"KV slot {slot} is free (not allocated)")

    def truncate(self, slot: int, length: int) -> None:
        """Roll back to `length` committed tokens (rejected drafts): a length update."""
        self.check_owned(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"truncate slot {slot} to {length}: must be in "
                             f"0..{self.lengths[slot]} (current length)")
        self.lengths[slot] = length
