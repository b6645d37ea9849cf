"""The KV block manager (pure Python): tables grow and shrink by whole blocks, the pool is
conserved, and allocation is deterministic (tensor-parallel ranks agree on block ids)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.models.block_manager import BlockManager, CacheFullError
from pipeline.models.kv_cache import KVCache


def test_tables_grow_by_whole_blocks_and_rollback_frees_only_blocks_past_the_end():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.add(0)
    bm.ensure(0, 9)                      # 9 tokens: 3 blocks
    assert bm.tables[0] == [0, 1, 2] and bm.num_free == 3
    bm.ensure(0, 12)                     # still 3 blocks
    assert bm.tables[0] == [0, 1, 2]
    bm.truncate(0, 5)                    # rejected drafts: block 2 wholly past token 4
    assert bm.tables[0] == [0, 1] and bm.num_free == 4
    bm.truncate(0, 4)
    assert bm.tables[0] == [0]
    bm.add(1)
    bm.ensure(1, 8)                      # first freed, first reused: 3, 4 then 2
    assert bm.tables[1] == [3, 4]
    bm.remove(0)
    assert bm.num_free == 4 and bm.ref_counts == [0, 0, 0, 1, 1, 0]
    bm.check()


def test_a_request_the_pool_cannot_hold_takes_nothing():
    bm = BlockManager(num_blocks=3, block_size=16)
    bm.add(0)
    bm.ensure(0, 20)
    bm.add(1)
    with pytest.raises(CacheFullError, match="2 more blocks needed, 1 of 3 free"):
        bm.ensure(1, 17)
    assert bm.tables[1] == [] and bm.num_free == 1


def test_kv_cache_reserve_is_all_or_nothing_and_the_default_pool_is_one_row_per_slot():
    cache = KVCache(num_layers=1, num_slots=2, max_len=40, num_kv_heads=1, head_dim=4,
                    block_size=16)
    assert cache.num_blocks == 2 * 3 and tuple(cache.k[0].shape) == (6, 16, 1, 4)
    a, b = cache.allocate(), cache.allocate()
    cache.reserve([a], [33])
    assert cache.table(a) == [0, 1, 2]
    with pytest.raises(CacheFullError):
        cache.reserve([a, b], [49, 33])  # a needs 1 more, b 3: 4 > 3 free
    assert cache.table(a) == [0, 1, 2] and cache.table(b) == [] and cache.blocks.num_free == 3
    cache.reserve([a, b], [48, 48])
    assert cache.table(b) == [3, 4, 5] and cache.blocks.num_free == 0
    cache.free(a)
    assert cache.blocks.num_free == 3
    cache.free(b)
    assert cache.blocks.num_free == 6
    cache.blocks.check()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(2, 24),
       st.lists(st.tuples(st.sampled_from(["add", "grow", "cut", "remove"]),
                          st.integers(0, 5), st.integers(0, 64)), max_size=80))
def test_any_sequence_of_operations_conserves_the_pool(block_size, num_blocks, ops):
    """free + in use == pool; every block held by exactly one table; a table holds exactly the
    blocks its length needs after grow/cut; identical call sequences give identical ids."""
    twins = [BlockManager(num_blocks, block_size) for _ in range(2)]
    lengths: dict[int, int] = {}
    for op, seq, n in ops:
        for bm in twins:
            if op == "add" and seq not in bm.tables:
                bm.add(seq)
            elif op == "grow" and seq in bm.tables:
                try:
                    bm.ensure(seq, n)
                except CacheFullError:
                    continue
            elif op == "cut" and seq in bm.tables:
                bm.truncate(seq, min(n, lengths.get(seq, 0)))
            elif op == "remove" and seq in bm.tables:
                bm.remove(seq)
        bm = twins[0]
        if op == "add":
            lengths.setdefault(seq, 0)
        elif op == "grow" and seq in bm.tables and bm.missing(seq, n) == 0:
            lengths[seq] = max(lengths.get(seq, 0), n)
        elif op == "cut" and seq in bm.tables:
            lengths[seq] = min(n, lengths.get(seq, 0))
            assert len(bm.tables[seq]) == bm.blocks_for(lengths[seq])
        elif op == "remove":
            lengths.pop(seq, None)
        bm.check()
        held = [b for t in bm.tables.values() for b in t]
        assert len(held) == len(set(held))
        assert bm.num_free + len(held) == num_blocks
        assert twins[0].tables == twins[1].tables
