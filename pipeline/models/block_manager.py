"""Which KV blocks each sequence holds: a pool of fixed-size blocks, one block table per sequence.

Pure Python (no torch), nano-vllm style. A sequence's tokens 0..n-1 live in its table's blocks,
token i at row i % block_size of block `table[i // block_size]`.

Invariants:
- every block is either free (in the free list, ref count 0) or referenced by at least one
  table (ref count = how many tables hold it); free + in use == num_blocks;
- a table holds exactly `blocks_for(length)` blocks once `ensure` ran for that length;
  `truncate` frees the blocks wholly past the new end (rejected drafts), nothing else;
- allocation, append and free are O(1) per block; the order is deterministic (first freed,
  first reused), so every tensor-parallel rank that applies the same calls holds the same
  block ids.
"""

from __future__ import annotations

from collections import deque


class CacheFullError(RuntimeError):
    """No free sequence slot, or not enough free blocks for a sequence to grow."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockManager needs num_blocks > 0 and block_size > 0, "
                             f"got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def add(self, seq: int) -> None:
        if seq in self.tables:
            raise ValueError(f"sequence {seq} already has a block table")
        self.tables[seq] = []

    def missing(self, seq: int, num_tokens: int) -> int:
        """Blocks `seq` still needs to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables[seq]))

    def ensure(self, seq: int, num_tokens: int) -> None:
        """Grow `seq`'s table to hold `num_tokens` tokens; CacheFullError (nothing taken) when
        the pool has too few free blocks."""
        need = self.missing(seq, num_tokens)
        if need > len(self._free):
            raise CacheFullError(f"KV cache full: {need} more blocks needed, "
                                 f"{len(self._free)} of {self.num_blocks} free")
        table = self.tables[seq]
        for _ in range(need):
            block = self._free.popleft()
            self.ref_counts[block] = 1
            table.append(block)

    def truncate(self, seq: int, num_tokens: int) -> None:
        """Keep the blocks holding tokens 0..num_tokens-1; free the ones wholly past them."""
        table = self.tables[seq]
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def remove(self, seq: int) -> None:
        for block in reversed(self.tables.pop(seq)):
            self._release(block)

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)

    def check(self) -> None:
        """Assert the invariants (tests, leak checks): ref counts match the tables."""
        counts = [0] * self.num_blocks
        for table in self.tables.values():
            for block in table:
                counts[block] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is in the free list twice")
        for block, (want, got) in enumerate(zip(counts, self.ref_counts)):
            if want != got or (got == 0) != (block in free):
                raise AssertionError(f"block {block}: ref count {got}, held {want} times, "
                                     f"{'free' if block in free else 'not free'}")
