"""scripts/replay_ngram.py: the replay of n-gram drafting over recorded greedy outputs."""

from __future__ import annotations

import os
import sys

import pytest
from support.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import replay_ngram

# A prompt whose text the output copies after a detour of its own.
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]
OUT = [20, 21, 3, 4, 5, 6, 7, 8, 9, 22, 4, 23]


def cost(rows: int) -> float:
    return 1.0 + 0.1 * (rows - 1)  # a verify row a tenth of a plain decode


def test_drafts_are_kept_while_they_equal_the_output():
    assert replay_ngram.accepted([3, 4, 9], OUT, 2) == 2
    assert replay_ngram.accepted([], OUT, 0) == 0
    assert replay_ngram.accepted([22, 4, 23, 99], OUT, 9) == 3  # the output ends


def test_match_lengths_and_what_their_drafts_keep():
    kept = replay_ngram.by_match_length([(PROMPT, OUT)], k=4, max_n=3)
    # positions 0-2 and 10 end in a token seen nowhere before; at 3 the 1-token match "3" drafts
    # 4 5 6 7 (all kept), at 11 "4" drafts 5 6 7 8 (none); at 5-9 "3 4 5" ... "7 8 9" match
    assert kept == {0: [0, 0, 0, 0], 1: [4, 0], 2: [4], 3: [4, 3, 2, 1, 0]}


def test_a_replay_walks_the_output_drafting_after_each_long_enough_match():
    # min_n 1: plain x3, then 4 kept (5 rows), 1 kept (9 after "6 7 8"), plain, 0 kept: 8.2 decodes
    assert replay_ngram.replay([(PROMPT, OUT)], 4, 1, 3, cost) == pytest.approx(12 / 8.2)
    # min_n 2: "3" alone is no match, "3 4" is, one step later: 8.8 decodes
    assert replay_ngram.replay([(PROMPT, OUT)], 4, 2, 3, cost) == pytest.approx(12 / 8.8)
    # nothing recurs: nothing is drafted, one token per plain step
    assert replay_ngram.replay([([1, 2, 3], [4, 5, 6])], 4, 1, 3, cost) == pytest.approx(1.0)


@pytest.mark.parametrize("min_n", [1, 2, 3])
def test_the_oracle_bounds_every_replay(min_n):
    speed = replay_ngram.replay([(PROMPT, OUT)], 4, min_n, 3, cost)
    assert speed <= replay_ngram.oracle([(PROMPT, OUT)], 4, 3, cost) + 1e-9


def test_the_oracle_drafts_only_what_it_knows_is_kept():
    # plain x3, 4 drafts at 3 (all kept), 1 draft at 8 (kept), plain at 10 and 11: 7.5 decodes
    assert replay_ngram.oracle([(PROMPT, OUT)], 4, 3, cost) == pytest.approx(12 / 7.5)
