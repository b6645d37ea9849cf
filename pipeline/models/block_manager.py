"""Which KV blocks each sequence holds: a pool of fixed-size blocks, one block table per sequence,
and (optionally) automatic prefix caching of full blocks of committed tokens.

Pure Python (no torch), nano-vllm style. A sequence's tokens 0..n-1 live in its table's blocks,
token i at row i % block_size of block `table[i // block_size]`.

Prefix caching: once the caller says a sequence's first n tokens are committed (`commit`), each
full block among them gets a chained key: a hash of (its parent block's key, its tokens), so a
key names a whole prefix; the tokens are kept too and compared on a hit, so a hash collision
can never hand out the wrong KV. `attach` gives a new sequence the longest chain of cached
blocks matching its tokens (shared: ref count + 1). A block whose last user leaves keeps its key
and waits, reusable, at the back of the free list; allocation takes blocks without a key first,
then evicts the least recently freed cached block. Draft tokens never get a key: only what the
caller committed does, and a block is keyed only when all its tokens are committed.

Invariants:
- every block is in use (ref count = number of tables holding it, > 0), cached (ref count 0,
  keyed, in the free list) or free (ref count 0, no key, in the free list);
  free + cached + in use == num_blocks;
- a table holds exactly `blocks_for(length)` blocks once `ensure` ran for that length;
  `truncate` frees the blocks wholly past the new end (rejected drafts), nothing else;
- a keyed block's rows are never written again while it is keyed (writes go past the
  committed end, into blocks of the writer's own; truncating into a keyed block drops its key
  if the block is the caller's alone, and is refused if it is shared);
- allocation, append, free and a hit are O(1) per block; the order is deterministic, so every
  tensor-parallel rank that applies the same calls holds the same block ids;
- `history` chains every decision (blocks handed to a sequence, hits, blocks freed) into 16
  bytes: two managers that made the same decisions from an empty pool have the same history,
  and once they differ they never agree again (how ranks check each other, at O(1) a step).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from pipeline.block_hash import chain_key


class CacheFullError(RuntimeError):
    """No free sequence slot, or not enough free blocks for a sequence to grow."""


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
        self._cached: dict[bytes, int] = {}  # key -> block
        self._keyed: dict[int, tuple[int, bytes]] = {}  # seq -> (keyed blocks, last key)
        self.num_cached_free = 0  # keyed blocks with ref count 0
        self.history = b""  # chain of decisions (module docstring)

    def _note(self, *values: int) -> None:
        self.history = hashlib.blake2b(self.history + array("q", values).tobytes(),
                                       digest_size=16).digest()

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (free + cached-and-unreferenced)."""
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
        """Give the new, empty sequence `seq` the longest run of cached full blocks matching
        `tokens`, covering at most `limit` tokens; returns how many tokens they hold."""
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
        """`tokens` (the sequence's first len(tokens) tokens) are committed: key every full
        block among them that has no key yet."""
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
        """Blocks `seq` still needs to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables[seq]))

    def ensure(self, seq: int, num_tokens: int) -> None:
        """Grow `seq`'s table to hold `num_tokens` tokens; CacheFullError (nothing taken) when
        the pool has too few free or evictable blocks."""
        need = self.missing(seq, num_tokens)
        if need > len(self._free):
            raise CacheFullError(f"KV cache full: {need} more blocks needed, "
                                 f"{len(self._free)} of {self.num_blocks} free")
        table = self.tables[seq]
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            if self._key[block] is not None:  # evict the least recently used cached block
                del self._cached[self._key[block]]
                self._key[block] = self._tokens[block] = None
                self.num_cached_free -= 1
            self.ref_counts[block] = 1
            table.append(block)
        if need:
            self._note(1, seq, *table[-need:])

    def truncate(self, seq: int, num_tokens: int) -> None:
        """Keep the blocks holding tokens 0..num_tokens-1; free the ones wholly past them."""
        table = self.tables[seq]
        keep = self.blocks_for(num_tokens)
        if len(table) > keep:
            self._note(2, seq, *table[keep:])
        while len(table) > keep:
            self._release(table.pop())
        done, _key = self._keyed[seq]
        if num_tokens < done * self.block_size:  # back into keyed blocks (never, by the engine)
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
            self._free[block] = None  # cached: the back (most recently used)
            if self._key[block] is None:
                self._free.move_to_end(block, last=False)  # nothing to keep: used first
            else:
                self.num_cached_free += 1

    def check(self) -> None:
        """Assert the invariants (tests, leak checks): ref counts match the tables, the free
        list holds exactly the unreferenced blocks, the cache index matches the keys."""
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
