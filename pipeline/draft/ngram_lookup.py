"""Prompt lookup over the last `window` tokens: up to k tokens after the most recent earlier
occurrence of the longest suffix n-gram (min_n <= n <= max_n) that has one, [] if none does.
Vectorised: `max_n` whole-array comparisons, O(window * max_n) whatever the sequence length."""

from __future__ import annotations

import numpy as np

DEFAULT_WINDOW = 4096


def propose_ngram(
    tokens: np.ndarray,
    k: int,
    min_n: int = 1,
    max_n: int = 4,
    window: int = DEFAULT_WINDOW,
) -> list[int]:
    if k < 0 or min_n < 1 or max_n < min_n or window < 2:
        raise ValueError(
            f"need k >= 0, 1 <= min_n <= max_n and window >= 2; "
            f"got k={k}, min_n={min_n}, max_n={max_n}, window={window}"
        )
    t = np.asarray(tokens).reshape(-1)[-window:]
    length = t.shape[0]
    if k == 0 or length < min_n + 1:
        return []
    ends = length - 1  # occurrence ends e = 0 .. L-2: a token must follow
    # match_len[e] = number of d in 0..max_n-1, counted while consecutive, with t[e-d] == t[L-1-d]
    match_len = np.zeros(ends, dtype=np.int64)
    still = np.ones(ends, dtype=bool)
    for d in range(min(max_n, ends)):
        same = np.zeros(ends, dtype=bool)
        same[d:] = t[: ends - d] == t[length - 1 - d]
        still &= same
        if not still.any():
            break
        match_len += still
    best = int(match_len.max())
    if best < min_n:
        return []
    end = int(np.flatnonzero(match_len >= best)[-1])
    return t[end + 1 : end + 1 + k].tolist()
