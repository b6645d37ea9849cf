"""A bounded token index: what followed the longest earlier match of a context, and how often.
A ring of token slots with zlib-style hash chains per anchor length (`head[bucket]`: the newest
position hashing there, `prev[pos]`: the next older one); docs/suffix-drafting.md."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

ANCHORS = (8, 3, 1)  # tried longest first: a rare long match beats a recent short one
SEPARATOR = -1  # never a token id, so it matches no context
_MULT = 0x9E3779B97F4A7C15  # Fibonacci hashing, mod 2**64
_M64 = (1 << 64) - 1
_SMALL = 16  # chunks up to this long are linked in plain Python: numpy's per-call cost dominates


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


@dataclass
class Match:
    # confidence[j]: the share of the occurrences whose continuation agrees with tokens[:j+1]
    tokens: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    match_len: int = 0
    occurrences: int = 0

    @property
    def score(self) -> float:
        return float(sum(self.confidence))


class TokenIndex:
    def __init__(self, capacity: int, max_depth: int = 32, max_candidates: int = 64,
                 max_runs: int | None = None, initial: int | None = None) -> None:
        if capacity < 1 or max_depth < 1 or max_candidates < 1:
            raise ValueError("TokenIndex: capacity, max_depth and max_candidates must be >= 1")
        self.capacity = capacity
        self.max_depth = max_depth
        self.max_candidates = max_candidates
        self.max_runs = max_runs
        self._max_slots = _pow2(capacity)
        self._alloc(self._max_slots if initial is None else min(_pow2(initial), self._max_slots))
        self.end = 0
        self.oldest = 0
        self._runs: deque[int] = deque()
        self._open = False

    def __len__(self) -> int:
        return self.end - self.oldest

    @property
    def num_runs(self) -> int:
        return len(self._runs)

    @property
    def nbytes(self) -> int:
        return self._buf.nbytes + sum(h.nbytes + p.nbytes
                                      for h, p in zip(self._head.values(), self._prev.values()))

    def _alloc(self, slots: int) -> None:
        self._mask = slots - 1
        self._bits = slots.bit_length() - 1
        self._buf = np.full(slots, SEPARATOR, dtype=np.int32)
        self._head = {a: np.full(slots, -1, dtype=np.int64) for a in ANCHORS}
        self._prev = {a: np.full(slots, -1, dtype=np.int64) for a in ANCHORS}

    def _reserve(self, live: int) -> None:
        # growing moves every token and rebuilds every chain: buckets depend on the size
        slots = self._mask + 1
        if live <= slots:
            return
        while slots < live:
            slots *= 2
        held = self.tokens(self.oldest, self.end)
        self._alloc(min(slots, self._max_slots))
        self._buf[np.arange(self.oldest, self.end) & self._mask] = held
        for a in ANCHORS:
            self._link(a, self.oldest)

    def extend(self, tokens: list[int] | np.ndarray) -> None:
        new = np.asarray(tokens, dtype=np.int32).reshape(-1)[-self.capacity:]
        if new.size == 0:
            return
        self._reserve(min(self.capacity, self.end + new.size - self.oldest))
        if not self._open:
            self._runs.append(self.end)
            self._open = True
        start, self.end = self.end, self.end + new.size
        self._buf[np.arange(start, self.end) & self._mask] = new
        self._evict(self.end - self.capacity)
        if new.size <= _SMALL:
            self._link_small(start)
            return
        for a in ANCHORS:
            self._link(a, start)

    def end_run(self) -> None:
        if not self._open:
            return
        self.extend([SEPARATOR])
        self._open = False
        if self.max_runs is not None:
            while len(self._runs) > self.max_runs:
                self._runs.popleft()
                self._evict(self._runs[0])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        start = max(start, self.oldest)
        return self._buf[np.arange(start, max(start, stop)) & self._mask].astype(np.int64)

    def _evict(self, new_oldest: int) -> None:
        self.oldest = max(self.oldest, new_oldest)
        while len(self._runs) > 1 and self._runs[1] <= self.oldest:
            self._runs.popleft()

    def _link(self, a: int, start: int) -> None:
        pos = np.arange(max(start, self.oldest + a - 1), self.end, dtype=np.int64)
        if pos.size == 0:
            return
        grams = self._buf[(pos[:, None] - np.arange(a)) & self._mask]
        pos = pos[(grams >= 0).all(axis=1)]
        if pos.size == 0:
            return
        buckets = self._bucket(grams[(grams >= 0).all(axis=1)])
        order = np.argsort(buckets, kind="stable")  # within a bucket: oldest first
        b, p = buckets[order], pos[order]
        same = np.zeros(b.size, dtype=bool)
        same[1:] = b[1:] == b[:-1]
        prev = self._head[a][b]
        prev[same] = p[:-1][same[1:]]
        self._prev[a][p & self._mask] = prev
        last = np.ones(b.size, dtype=bool)
        last[:-1] = ~same[1:]
        self._head[a][b[last]] = p[last]

    def _link_small(self, start: int) -> None:
        first = max(start - max(ANCHORS) + 1, self.oldest)
        window = self._buf[np.arange(first, self.end) & self._mask].tolist()
        for pos in range(max(start, self.oldest), self.end):
            for a in ANCHORS:
                gram = window[pos - a + 1 - first: pos + 1 - first] if pos - a + 1 >= first else []
                if len(gram) < a or min(gram) < 0:
                    continue
                bucket = self._bucket_of(gram)
                self._prev[a][pos & self._mask] = self._head[a][bucket]
                self._head[a][bucket] = pos

    def _bucket(self, grams: np.ndarray) -> np.ndarray:
        h = np.zeros(grams.shape[0], dtype=np.uint64)
        mult = np.uint64(_MULT)
        for col in grams.T.astype(np.uint64):
            h = (h ^ col) * mult  # wraps mod 2**64, as _bucket_of's mask does
        return (h >> np.uint64(64 - self._bits)).astype(np.int64)

    def _bucket_of(self, gram: list[int]) -> int:
        h = 0
        for t in reversed(gram):
            h = ((h ^ t) * _MULT) & _M64
        return h >> (64 - self._bits)

    def match(self, context: np.ndarray, max_tokens: int, min_score: float = 0.0,
              spec_factor: float = 1.0, exclude_last: bool = False) -> Match:
        """The most frequent continuation of the longest match of `context` among the newest
        `max_candidates` occurrences of its longest anchor, while confidence >= `min_score`;
        at most `spec_factor * match_len` tokens. `exclude_last`: skip the context itself."""
        context = np.asarray(context, dtype=np.int64)[-self.max_depth:]
        for a in ANCHORS:
            if a > context.size:
                continue
            cands = self._candidates(a, context[-a:], exclude_last)
            if cands.size == 0:
                continue
            lens = self._match_lens(cands, context)
            true = lens >= a  # another gram in the same bucket matches less than a
            if not true.any():
                continue
            best = int(lens[true].max())
            occ = cands[lens == best]
            limit = min(max_tokens, int(spec_factor * best))
            tokens, conf = self._follow(occ, limit, min_score)
            return Match(tokens, conf, best, int(occ.size))
        return Match()

    def _candidates(self, a: int, gram: np.ndarray, exclude_last: bool) -> np.ndarray:
        pos = int(self._head[a][self._bucket_of(gram.tolist())])
        prev = self._prev[a]
        out: list[int] = []
        while pos >= self.oldest and len(out) < self.max_candidates:
            if not (exclude_last and pos == self.end - 1):
                out.append(pos)
            pos = int(prev[pos & self._mask])
        return np.asarray(out, dtype=np.int64)

    def _match_lens(self, cands: np.ndarray, context: np.ndarray) -> np.ndarray:
        back = cands[:, None] - np.arange(context.size)
        same = (self._buf[back & self._mask] == context[::-1]) & (back >= self.oldest)
        return np.cumprod(same, axis=1).sum(axis=1)

    def _follow(self, occ: np.ndarray, limit: int, min_score: float
                ) -> tuple[list[int], list[float]]:
        if limit <= 0:
            return [], []
        ahead = occ[:, None] + 1 + np.arange(limit)
        cont = self._buf[ahead & self._mask].astype(np.int64)
        valid = np.cumprod((ahead < self.end) & (cont >= 0), axis=1).astype(bool)
        total = occ.size
        alive = np.ones(total, dtype=bool)
        tokens: list[int] = []
        conf: list[float] = []
        for j in range(limit):
            here = alive & valid[:, j]
            n_here = int(here.sum())
            if n_here == 0:
                break
            if n_here == 1:  # one occurrence left: the rest of its run, at a constant score
                row = int(np.flatnonzero(here)[0])
                score = 1.0 / total
                if score < min_score:
                    break
                rest = cont[row, j:][valid[row, j:]]
                tokens += rest.tolist()
                conf += [score] * int(rest.size)
                break
            values, first, counts = np.unique(cont[here, j], return_index=True,
                                              return_counts=True)
            # most frequent; ties go to the newest occurrence (rows are newest first)
            pick = int(np.lexsort((first, -counts))[0])
            score = float(counts[pick]) / total
            if score < min_score:
                break
            tokens.append(int(values[pick]))
            conf.append(score)
            alive = here & (cont[:, j] == values[pick])
        return tokens, conf
