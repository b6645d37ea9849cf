"""Prefix affinity (pipeline/routing/prefix_affinity.py): whole-block chained keys (the prefix
cache's own, pipeline/block_hash.py), the longest matched prefix wins unless loads differ, dead
replicas are forgotten, the table is bounded."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.paths import REPO

from pipeline.block_hash import chain_key
from pipeline.models.block_manager import BlockManager
from pipeline.routing.prefix_affinity import PrefixAffinity, block_keys

SYSTEM = list(range(100, 164))  # 4 blocks of 16


def test_keys_cover_whole_blocks_only_and_chain_on_everything_before():
    assert block_keys(list(range(15)), 16) == []
    assert len(block_keys(list(range(47)), 16)) == 2
    a = block_keys([1] * 16 + [2] * 16, 16)
    b = block_keys([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same second block, different first: different key
    assert block_keys([1] * 16 + [2] * 16 + [9], 16) == a
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1], 0)


def test_a_key_is_blake2b_of_the_parent_key_and_the_int64_ids():
    """Stable across processes and runs (a literal), and chained: key i covers blocks 0..i."""
    assert block_keys([1, 2, 3, 4], 4)[0].hex() == "087a24230771ee662be37e5493b333d7"
    keys = block_keys(list(range(40)), 8)
    assert keys == [chain_key(keys[i - 1] if i else b"", list(range(8 * i, 8 * i + 8)))
                    for i in range(5)]


@given(st.lists(st.integers(0, 1 << 20), max_size=80), st.sampled_from([1, 4, 16]))
def test_the_routers_keys_are_the_keys_the_prefix_cache_holds_the_prompt_under(tokens,
                                                                              block_size):
    bm = BlockManager(num_blocks=100, block_size=block_size, prefix_caching=True)
    bm.add(0)
    bm.ensure(0, len(tokens))
    bm.commit(0, tokens)  # a replica prefilled the prompt: its full blocks are keyed
    cached = [bm._key[b] for b in bm.tables[0][:len(tokens) // block_size]]
    assert PrefixAffinity(block_size=block_size).keys(tokens) == cached


def test_the_router_process_does_not_import_torch():
    code = "import sys, pipeline.routing.prefix_affinity; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_replica_holding_the_longest_prefix_is_chosen():
    aff = PrefixAffinity(block_size=16, imbalance_threshold=8)
    aff.record("a", aff.keys(SYSTEM))
    aff.record("b", aff.keys(SYSTEM + [7] * 32))
    turn2 = aff.keys(SYSTEM + [7] * 32 + [8] * 16)
    assert aff.matched_blocks(turn2, ["a", "b", "c"]) == {"a": 4, "b": 6, "c": 0}
    assert aff.choose(turn2, {"a": 0, "b": 3, "c": 0}) == "b"
    # equal prefixes: the less loaded one
    assert aff.choose(aff.keys(SYSTEM), {"a": 2, "b": 1}) == "b"


def test_no_match_or_imbalanced_loads_leave_the_choice_to_load_balancing():
    aff = PrefixAffinity(block_size=16, imbalance_threshold=2)
    assert aff.choose(aff.keys(SYSTEM), {"a": 0, "b": 0}) is None  # nothing learnt yet
    aff.record("a", aff.keys(SYSTEM))
    assert aff.choose(aff.keys(SYSTEM), {"a": 2, "b": 0}) == "a"  # a spread of 2 is fine
    assert aff.choose(aff.keys(SYSTEM), {"a": 3, "b": 0}) is None  # 3 > threshold
    assert aff.choose(aff.keys([5] * 64), {"a": 0, "b": 0}) is None  # another prompt
    assert aff.choose(aff.keys(SYSTEM[:10]), {"a": 0, "b": 0}) is None  # no whole block


def test_a_dead_replica_is_forgotten_and_affinity_relearns():
    aff = PrefixAffinity(block_size=16)
    aff.record("a", aff.keys(SYSTEM))
    aff.forget("a")
    assert len(aff) == 0
    assert aff.choose(aff.keys(SYSTEM), {"a2": 0, "b": 0}) is None
    aff.record("a2", aff.keys(SYSTEM))  # the restarted replica served the next one
    assert aff.choose(aff.keys(SYSTEM), {"a2": 0, "b": 0}) == "a2"
    aff.record("b", aff.keys(SYSTEM))
    aff.keep_only(["b"])  # a2 left the deployment
    assert aff.matched_blocks(aff.keys(SYSTEM), ["a2", "b"]) == {"a2": 0, "b": 4}


def test_the_table_is_bounded_least_recently_recorded_first():
    aff = PrefixAffinity(block_size=1, max_blocks=3)
    aff.record("a", aff.keys([1, 2]))
    aff.record("b", aff.keys([9]))
    aff.record("a", aff.keys([1]))  # refreshes block [1]
    aff.record("b", aff.keys([8]))  # evicts [1, 2]'s second block, the oldest
    assert len(aff) == 3
    assert aff.matched_blocks(aff.keys([1, 2]), ["a"]) == {"a": 1}


@given(st.lists(st.tuples(st.sampled_from("abc"), st.lists(st.integers(0, 3), max_size=12)),
                max_size=20),
       st.lists(st.integers(0, 3), max_size=12),
       st.dictionaries(st.sampled_from("abcd"), st.integers(0, 5), min_size=1))
def test_a_choice_is_a_candidate_holding_a_longest_prefix_within_the_threshold(history, prompt,
                                                                               loads):
    aff = PrefixAffinity(block_size=2, imbalance_threshold=2, max_blocks=1000)
    for replica, ids in history:
        aff.record(replica, aff.keys(ids))
    keys = aff.keys(prompt)
    chosen = aff.choose(keys, loads)
    matched = aff.matched_blocks(keys, loads)
    # brute force: the longest leading run of blocks each replica was sent in one prompt
    served = {r: max((_common(aff.keys(ids), keys) for rr, ids in history if rr == r),
                     default=0) for r in loads}
    assert matched == served
    if chosen is None:
        assert max(loads.values()) - min(loads.values()) > 2 or max(served.values()) == 0
    else:
        assert chosen in loads and served[chosen] == max(served.values()) > 0
        assert max(loads.values()) - min(loads.values()) <= 2


def _common(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
