"""Prompt-lookup n-gram proposer (no draft model): guess that the text repeats itself.

Let ``t`` be the last `window` tokens of the sequence (prompt + output so far), ``L = len(t)``.
For n from `max_n` down to `min_n`, the *suffix n-gram* is ``t[L-n:]``; an *earlier
occurrence* is a start ``i < L - n`` with ``t[i:i+n] == t[L-n:]`` (so at least one token follows
it). The proposal is the up-to-k tokens ``t[i+n : i+n+k]`` after the **most recent** (largest
``i``) earlier occurrence of the **longest** suffix n-gram that has one; ``[]`` if none does.

The search is vectorised: for each end position ``e`` of ``t[:-1]`` it counts how many tokens
ending at ``e`` agree with the suffix (up to `max_n`), with `max_n` whole-array comparisons, so a
call costs ``O(window * max_n)`` whatever the sequence length.
"""

from __future__ import annotations

import numpy as np

DEFAULT_WINDOW = 4096


def propose_ngram(
    tokens: np.ndarray,  # [L] integer token ids, prompt + output so far
    k: int,
    min_n: int = 1,
    max_n: int = 4,
    window: int = DEFAULT_WINDOW,
) -> list[int]:
    """Up to `k` draft tokens by prompt lookup (module docstring); ``[]`` when no suffix n-gram
    with ``min_n <= n <= max_n`` occurs earlier within the last `window` tokens."""
    if k < 0 or min_n < 1 or max_n < min_n or window < 2:
        raise ValueError(
            f"need k >= 0, 1 <= min_n <= max_n and window >= 2; "
            f"got k={k}, min_n={min_n}, max_n={max_n}, window={window}"
        )
    t = np.asarray(tokens).reshape(-1)[-window:]
    length = t.shape[0]
    if k == 0 or length < min_n + 1:
        return []
    ends = length - 1  # candidate occurrence ends e = 0 .. L-2 (a token must follow)
    # match_len[e] = number of d in 0..max_n-1, counted while consecutive, with t[e-d] == t[L-1-d]
    match_len = np.zeros(ends, dtype=np.int64)
    still = np.ones(ends, dtype=bool)
    for d in range(min(max_n, ends)):
        # positions e >= d can compare t[e-d]; the suffix token t[L-1-d] is one scalar
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
