"""Prompt-lookup n-gram proposer: literal proposals and a brute-force property check."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.draft.ngram_lookup import propose_ngram


def _arr(xs: list[int]) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_repeat_found_returns_the_continuation():
    assert propose_ngram(_arr([5, 6, 7, 8, 9, 5, 6]), k=3) == [7, 8, 9]


def test_longest_suffix_ngram_is_preferred_over_a_more_recent_shorter_one():
    # suffix [1, 2, 3]: the 3-gram occurs at 0 (-> 10); the 1-gram [3] occurs later (-> 20)
    tokens = _arr([1, 2, 3, 10, 11, 3, 20, 1, 2, 3])
    assert propose_ngram(tokens, k=2) == [10, 11]
    assert propose_ngram(tokens, k=2, max_n=1) == [20, 1]


def test_most_recent_occurrence_wins():
    tokens = _arr([4, 4, 1, 4, 2, 4, 3, 9, 4])
    assert propose_ngram(tokens, k=1, max_n=1) == [3]
    tokens = _arr([7, 8, 1, 7, 8, 2, 7, 8])
    assert propose_ngram(tokens, k=3) == [2, 7, 8]


def test_no_match_gives_empty_list():
    assert propose_ngram(_arr([1, 2, 3, 4]), k=3) == []
    assert propose_ngram(_arr([]), k=3) == []
    assert propose_ngram(_arr([9]), k=3) == []


def test_min_n_rejects_short_matches():
    tokens = _arr([1, 2, 9, 3, 2])  # only the 1-gram [2] repeats
    assert propose_ngram(tokens, k=2, min_n=1) == [9, 3]
    assert propose_ngram(tokens, k=2, min_n=2) == []


def test_k_truncates_and_continuation_stops_at_sequence_end():
    tokens = _arr([1, 2, 3, 4, 5, 6, 1, 2])
    assert propose_ngram(tokens, k=2) == [3, 4]
    assert propose_ngram(tokens, k=10) == [3, 4, 5, 6, 1, 2]
    assert propose_ngram(tokens, k=0) == []


def test_overlapping_repeat_of_one_token():
    # suffix [1,1,1,1] (max_n=4) occurs earlier at 0 and 1; most recent is start 1 -> [1]
    assert propose_ngram(_arr([1, 1, 1, 1, 1, 1]), k=5) == [1]


def test_window_limits_the_search():
    tokens = _arr([42, 7] + [0, 1, 2, 3] * 3 + [42])
    assert propose_ngram(tokens, k=1) == [7]
    assert propose_ngram(tokens, k=1, window=8) == []


def test_long_sequence_is_cheap_and_correct():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=200_000)
    tokens[-3:] = tokens[199_000:199_003]
    assert propose_ngram(tokens, k=4) == tokens[199_003:199_007].tolist()


@pytest.mark.parametrize("bad", [{"k": -1}, {"min_n": 0}, {"min_n": 3, "max_n": 2}, {"window": 1}])
def test_invalid_arguments_raise(bad):
    kwargs = {"k": 2} | bad
    with pytest.raises(ValueError):
        propose_ngram(_arr([1, 2, 1]), **kwargs)


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for i in range(length - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(0, 6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_proposal_is_a_real_continuation_of_the_longest_most_recent_match(tokens, k, min_n, extra):
    max_n = min_n + extra
    proposal = propose_ngram(_arr(tokens), k, min_n=min_n, max_n=max_n)
    assert proposal == _reference(tokens, k, min_n, max_n)
    assert len(proposal) <= k
    if proposal:
        # some n-gram suffix of length >= min_n occurs earlier and is followed by the proposal
        length = len(tokens)
        assert any(
            tokens[i : i + n] == tokens[length - n :]
            and tokens[i + n : i + n + len(proposal)] == proposal
            for n in range(min_n, max_n + 1)
            for i in range(length - n)
        )
