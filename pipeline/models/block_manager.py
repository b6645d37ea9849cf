"""Which KV blocks each sequence holds (nano-vllm style): a pool of fixed-size blocks, one table
per sequence (token i in block `table[i // block_size]`) and optional prefix caching: a full block
of committed tokens gets a chained key (its parent's key and its tokens, compared on a hit), and
`attach` shares the longest cached chain; unreferenced keyed blocks are evicted LRU, after
unkeyed ones. O(1) per block and deterministic; `history` chains every decision into 16 bytes,
so tensor-parallel ranks can check they hold the same blocks (pipeline.verify.ranks)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from pipeline.block_hash import chain_key


class CacheFullError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockManager needs num_blocks > 0 and block_size > 0, "
                             f"got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_counts = [0] * num_blocks
        # ref count 0: uncached blocks at the front, cached ones behind in LRU order
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self._key: list[bytes | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._keyed: dict[int, tuple[int, bytes]] = {}  # seq -> (keyed blocks, last key)
        self.num_cached_free = 0  # keyed blocks with ref count 0
        self.history = b""

    def _note(self, *values: int) -> None:
        self.history = hashlib.blake2b(self.history + array("q", values).tobytes(),
                                       digest_size=16).digest()

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
        self._keyed[seq] = (0, b"")

    def attach(self, seq: int, tokens: list[int], limit: int) -> int:
        """Share the longest cached chain of `tokens` (<= `limit`); returns its tokens."""
        table = self.tables[seq]
        if table or not self.prefix_caching:
            return 0
        key, n = b"", 0
        while (n + 1) * self.block_size <= min(limit, len(tokens)):
            block_tokens = tokens[n * self.block_size:(n + 1) * self.block_size]
            next_key = chain_key(key, block_tokens)
            block = self._cached.get(next_key)
            if block is None or self._tokens[block] != tuple(block_tokens):
                break
            if self.ref_counts[block] == 0:
                del self._free[block]
                self.num_cached_free -= 1
            self.ref_counts[block] += 1
            table.append(block)
            key, n = next_key, n + 1
        self._keyed[seq] = (n, key)
        if n:
            self._note(3, seq, *table)
        return n * self.block_size

    def commit(self, seq: int, tokens: list[int]) -> None:
        """The sequence's first len(tokens) tokens are committed: key their full blocks."""
        if not self.prefix_caching:
            return
        table = self.tables[seq]
        done, key = self._keyed[seq]
        full = min(len(tokens) // self.block_size, len(table))
        for i in range(done, full):
            block_tokens = tokens[i * self.block_size:(i + 1) * self.block_size]
            key = chain_key(key, block_tokens)
            block = table[i]
            if self._key[block] is None and key not in self._cached:
                self._key[block] = key
                self._tokens[block] = tuple(block_tokens)
                self._cached[key] = block
        self._keyed[seq] = (max(done, full), key)

    def missing(self, seq: int, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.tables[seq]))

    def ensure(self, seq: int, num_tokens: int) -> None:
        """Grow `seq`'s table to `num_tokens` tokens; CacheFullError takes nothing."""
        need = self.missing(seq, num_tokens)
        if need > len(self._free):
            raise CacheFullError(f"KV cache full: {need} more blocks needed, "
                                 f"{len(self._free)} of {self.num_blocks} free")
        table = self.tables[seq]
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            if self._key[block] is not None:
                del self._cached[self._key[block]]
                self._key[block] = self._tokens[block] = None
                self.num_cached_free -= 1
            self.ref_counts[block] = 1
            table.append(block)
        if need:
            self._note(1, seq, *table[-need:])

    def truncate(self, seq: int, num_tokens: int) -> None:
        table = self.tables[seq]
        keep = self.blocks_for(num_tokens)
        if len(table) > keep:
            self._note(2, seq, *table[keep:])
        while len(table) > keep:
            self._release(table.pop())
        done, _key = self._keyed[seq]
        if num_tokens < done * self.block_size:  # into keyed blocks: the engine never does
            tail = table[-1]
            if num_tokens % self.block_size and self._key[tail] is not None:
                if self.ref_counts[tail] > 1:
                    raise ValueError(f"sequence {seq}: cannot truncate into a shared block")
                del self._cached[self._key[tail]]
                self._key[tail] = self._tokens[tail] = None
            self._keyed[seq] = self._rekey(seq, num_tokens // self.block_size)

    def _rekey(self, seq: int, blocks: int) -> tuple[int, bytes]:
        table = self.tables[seq]
        key = b""
        for i in range(blocks):
            block_key = self._key[table[i]]
            if block_key is None:
                return i, key
            key = block_key
        return blocks, key

    def remove(self, seq: int) -> None:
        self._note(4, seq, *self.tables[seq])
        for block in reversed(self.tables.pop(seq)):
            self._release(block)
        del self._keyed[seq]

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None
            if self._key[block] is None:
                self._free.move_to_end(block, last=False)  # nothing to keep: reused first
            else:
                self.num_cached_free += 1

    def check(self) -> None:
        """Assert the ref counts, the free list and the cache index agree (tests)."""
        counts = [0] * self.num_blocks
        for table in self.tables.values():
            for block in table:
                counts[block] += 1
        for block, (want, got) in enumerate(zip(counts, self.ref_counts)):
            if want != got or (got == 0) != (block in self._free):
                raise AssertionError(f"block {block}: ref count {got}, held {want} times, "
                                     f"{'free' if block in self._free else 'not free'}")
        keyed = {k: b for b, k in enumerate(self._key) if k is not None}
        if keyed != self._cached:
            raise AssertionError("the cache index does not match the blocks' keys")
        cached_free = sum(1 for b in self._free if self._key[b] is not None)
        if cached_free != self.num_cached_free:
            raise AssertionError(f"{cached_free} cached free blocks, counted "
                                 f"{self.num_cached_free}")
