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
    bm.ensure(1, 8)                      # freed blocks without a key go first, newest first
    assert bm.tables[1] == [1, 2]
    bm.remove(0)
    assert bm.num_free == 4 and bm.ref_counts == [0, 1, 1, 0, 0, 0]
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


def test_committed_full_blocks_are_cached_and_reused_by_a_later_sequence():
    bm = BlockManager(num_blocks=6, block_size=4, prefix_caching=True)
    bm.add(0)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    bm.ensure(0, 13)                      # 10 committed + 3 drafts: 4 blocks
    bm.commit(0, tokens)                  # two full blocks of committed tokens get keys
    bm.remove(0)
    assert bm.num_cached_free == 2 and bm.num_free == 6
    bm.add(1)
    # the longest cached prefix, whole blocks, at most `limit` tokens
    assert bm.attach(1, tokens[:8] + [99], limit=8) == 8
    assert bm.tables[1] == [0, 1] and bm.ref_counts[:2] == [1, 1]
    bm.add(2)
    assert bm.attach(2, [1, 2, 3, 4, 0, 0, 0, 0], limit=7) == 4   # diverges in block 2
    assert bm.ref_counts[0] == 2
    bm.add(3)
    assert bm.attach(3, [9, 9, 9, 9, 9], limit=4) == 0
    bm.check()


def test_drafts_past_the_committed_end_are_never_cached():
    bm = BlockManager(num_blocks=4, block_size=4, prefix_caching=True)
    bm.add(0)
    bm.ensure(0, 8)                       # 5 committed tokens + 3 drafts fill two blocks
    bm.commit(0, [1, 2, 3, 4, 5])
    bm.remove(0)
    bm.add(1)
    assert bm.attach(1, [1, 2, 3, 4, 5, 6, 7, 8, 9], limit=8) == 4  # block 2 was not keyed


def test_eviction_takes_blocks_without_a_key_first_then_the_least_recently_freed():
    bm = BlockManager(num_blocks=4, block_size=2, prefix_caching=True)
    for seq, toks in ((0, [1, 1]), (1, [2, 2])):
        bm.add(seq)
        bm.ensure(seq, 2)
        bm.commit(seq, toks)
    bm.remove(0)                           # block 0 cached first (older)
    bm.remove(1)                           # then block 1
    bm.add(2)
    bm.ensure(2, 4)                        # takes the two never-keyed blocks 2, 3
    assert bm.tables[2] == [2, 3] and bm.num_cached_free == 2
    bm.add(3)
    bm.ensure(3, 2)                        # evicts block 0, the least recently freed
    assert bm.tables[3] == [0]
    bm.add(4)
    assert bm.attach(4, [2, 2, 5], limit=2) == 2 and bm.tables[4] == [1]
    bm.add(5)
    assert bm.attach(5, [1, 1, 5], limit=2) == 0   # block 0 was evicted
    bm.check()


def test_truncating_into_a_shared_cached_block_is_refused():
    bm = BlockManager(num_blocks=4, block_size=4, prefix_caching=True)
    bm.add(0)
    bm.ensure(0, 4)
    bm.commit(0, [1, 2, 3, 4])
    bm.add(1)
    bm.attach(1, [1, 2, 3, 4, 5], limit=4)
    with pytest.raises(ValueError, match="shared block"):
        bm.truncate(1, 2)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 16]), st.integers(4, 40),
       st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(1, 40),
                          st.integers(0, 5)), max_size=40))
def test_prefix_caching_conserves_the_pool_and_only_hands_out_matching_blocks(
        block_size, num_blocks, ops):
    """Random requests over a few shared prefixes: attach, grow with drafts, commit part,
    reject drafts, finish. After every operation: free + cached + in use == pool, ref counts
    match the tables, and every attached block holds exactly the tokens the request asked for;
    at the end, with every request gone, every ref count is 0."""
    prefixes = [[7] * 40, [7] * 8 + [3] * 32, [5, 6] * 20]
    bm = BlockManager(num_blocks, block_size, prefix_caching=True)
    content: dict[int, tuple] = {}  # block -> tokens a sequence wrote/committed into it
    for seq, (p, tail, length, drafts) in enumerate(ops):
        tokens = prefixes[p][:length] + [seq % 7 + 8] * tail
        bm.add(seq)
        hit = bm.attach(seq, tokens, len(tokens) - 1)
        for i in range(hit // block_size):  # a hit hands out blocks holding exactly these
            assert content[bm.tables[seq][i]] == tuple(tokens[i * block_size:(i + 1) *
                                                              block_size])
        try:
            bm.ensure(seq, len(tokens) + drafts)
        except CacheFullError:
            bm.remove(seq)
            bm.check()
            continue
        bm.commit(seq, tokens)
        for i in range(len(tokens) // block_size):
            content[bm.tables[seq][i]] = tuple(tokens[i * block_size:(i + 1) * block_size])
        bm.truncate(seq, len(tokens))       # drafts rejected
        bm.check()
        in_use = sum(1 for r in bm.ref_counts if r > 0)
        assert bm.num_free + in_use == num_blocks
        if seq % 2:
            bm.remove(seq)
    for seq in list(bm.tables):
        bm.remove(seq)
    bm.check()
    assert bm.ref_counts == [0] * num_blocks and bm.num_free == num_blocks
