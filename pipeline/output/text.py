"""A request's text, step by step: the one home of the committed-text rule, stop strings,
hold-back and settling (docs/contracts.md, *Streaming*). A trailing U+FFFD, or a trailing
byte-fallback run (a byte that starts a new character can turn its text back into U+FFFDs),
is not committed yet."""

from __future__ import annotations

import functools
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.output.detokenizer import Detokenizer

REPLACEMENT = "\ufffd"

# (prefix_offset, read_offset, extra, tail, pending): a TextState's fields after a step's commit
TextUpdate = tuple[int, int, int, str, str]
# (state, retained output ids, this step's tokens whose text counts, skip_special_tokens)
TextRequest = tuple["TextState", array, list[int], bool]


@dataclass(slots=True)
class TextState:
    """vLLM-style offsets into `output_ids`: `ids[prefix_offset:read_offset]` is decode context
    (none for byte-level tokenizers); `extra` counts committed characters past its text.
    Everything emitted + `pending` == the committed text."""

    prefix_offset: int = 0
    read_offset: int = 0
    extra: int = 0
    tail: str = ""  # last (max stop length - 1) committed chars: context for the stop search
    pending: str = ""

    def apply(self, update: TextUpdate) -> None:
        self.prefix_offset, self.read_offset, self.extra, self.tail, self.pending = update


@dataclass(frozen=True, slots=True)
class StopStrings:
    """Prepared for the incremental search; requests with the same stop strings share one."""

    stops: tuple[str, ...]
    max_len: int
    last_char_re: re.Pattern
    # character c -> (k, s) for every proper prefix s[:k] ending in c, longest first
    by_last: dict[str, tuple[tuple[int, str], ...]]

    @staticmethod
    def build(stops: Sequence[str]) -> StopStrings | None:
        return _build_stop_strings(tuple(dict.fromkeys(stops))) if stops else None

    def may_complete(self, new: str) -> bool:
        return self.last_char_re.search(new) is not None

    def find(self, text: str, min_end: int) -> tuple[int, int, str] | None:
        """(start, end, stop) ending earliest past `min_end` (ties: the longest), or None."""
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            i = text.find(s, max(0, min_end - len(s) + 1))
            if i < 0:
                continue
            e = i + len(s)
            if best is None or e < best[1] or (e == best[1] and i < best[0]):
                best = (i, e, s)
        return best

    def held_len(self, text: str) -> int:
        """The longest suffix of `text` that a later token could complete into a stop string."""
        if not text:
            return 0
        for k, s in self.by_last.get(text[-1], ()):
            if k <= len(text) and text.endswith(s[:k]):
                return k
        return 0


@functools.lru_cache(maxsize=1024)
def _build_stop_strings(stops: tuple[str, ...]) -> StopStrings:
    by_last: dict[str, list[tuple[int, str]]] = {}
    for s in stops:
        for k in range(1, len(s)):
            by_last.setdefault(s[k - 1], []).append((k, s))
    table = {c: tuple(sorted(v, key=lambda e: -e[0])) for c, v in by_last.items()}
    last = "".join(sorted({re.escape(s[-1]) for s in stops}))
    return StopStrings(stops, max(map(len, stops)), re.compile(f"[{last}]"), table)


@dataclass(frozen=True, slots=True)
class StopStringHit:
    """`pos`: output position of the token holding the stop string's last character."""

    pos: int
    stop: str


@dataclass(frozen=True, slots=True)
class StopMatch:
    """The match's span is in `TextState.tail + new`."""

    hit: StopStringHit
    start: int
    end: int


@dataclass(slots=True)
class WindowText:
    """`full = decode(ids[prefix_offset:] + window)`; `full[:base]` was committed before this
    step, `full[:stable]` after it, so `new = full[base:stable]`."""

    window: list[int]
    full: str
    base: int
    stable: int
    new: str


def decode_windows(detok: Detokenizer, reqs: list[TextRequest]) -> list[WindowText]:
    context_free = detok.context_free
    byte_tokens = detok.byte_tokens
    seqs: list[list[int]] = []
    skips: list[bool] = []
    runs: list[int] = []  # index of the decode without the trailing byte run, or -1
    for ts, ids, window, skip in reqs:
        p = ts.prefix_offset
        seq = ids[p:].tolist() + window if p < len(ids) else window
        seqs.append(seq)
        skips.append(skip)
        if not context_free:
            seqs.append(ids[p : ts.read_offset].tolist())
            skips.append(skip)
        if byte_tokens and seq and seq[-1] in byte_tokens:
            runs.append(len(seqs))
            seqs.append(seq[: len(seq) - detok.trailing_byte_run(seq)])
            skips.append(skip)
        else:
            runs.append(-1)
    decoded = detok.decode_batch(seqs, skips)
    out = []
    at = 0
    for (ts, _, window, _), run_at in zip(reqs, runs):
        full = decoded[at]
        base = ts.extra if context_free else len(decoded[at + 1]) + ts.extra
        stable = len(full.rstrip(REPLACEMENT)) if full.endswith(REPLACEMENT) else len(full)
        if run_at >= 0:
            stable = min(stable, len(decoded[run_at]))
            at = run_at + 1
        else:
            at += 1 if context_free else 2
        out.append(WindowText(window, full, base, stable, full[base:stable] if stable > base else ""))
    return out


def find_stop(
    detok: Detokenizer,
    ts: TextState,
    ids: Sequence[int],
    wt: WindowText,
    stops: StopStrings,
    min_pos: int,
    skip: bool,
) -> StopMatch | None:
    """The first stop string completing in the window's committed text at or past `min_pos`."""
    new = wt.new
    if not new or not stops.may_complete(new):
        return None
    tail = ts.tail
    context = tail + new
    found = stops.find(context, len(tail))
    while found is not None:
        start, end, stop = found
        pos = len(ids) + _locate(detok, ts, ids, wt, end - len(tail), skip) - 1
        if pos >= min_pos:
            return StopMatch(StopStringHit(pos, stop), start, end)
        found = stops.find(context, end)
    return None


def _locate(
    detok: Detokenizer, ts: TextState, ids: Sequence[int], wt: WindowText, chars: int, skip: bool
) -> int:
    """Smallest k such that the first k window tokens commit `chars` new characters."""
    head = list(ids[ts.prefix_offset :])
    window = wt.window
    lo, hi = 1, len(window)
    while lo < hi:
        mid = (lo + hi) // 2
        if committed_len(detok, head + window[:mid], skip) - wt.base >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def committed_len(detok: Detokenizer, seq: list[int], skip: bool) -> int:
    return decode_windows(detok, [(TextState(), array("i"), seq, skip)])[0].stable


def stop_text(ts: TextState, wt: WindowText, match: StopMatch, include_stop: bool) -> str:
    """The last delta of a request a stop string ends: the unsent text up to the match."""
    sent = len(ts.tail) - len(ts.pending)
    cut = match.end if include_stop else match.start
    return (ts.tail + wt.new)[sent:cut]


def settled_text(ts: TextState, wt: WindowText) -> str:
    """The last delta of a request that ends otherwise: all of the retained ids' text."""
    return ts.pending + wt.full[wt.base :]


def release(
    detok: Detokenizer, ts: TextState, wt: WindowText, stops: StopStrings | None,
    include_stop: bool, end: int,
) -> tuple[str, TextUpdate]:
    """The text delta of a request that goes on, and its TextState after the step."""
    new = wt.new
    text = ts.pending + new if ts.pending else new
    pending = tail = ""
    if stops is not None:
        context = ts.tail + new
        if not include_stop:
            hold = min(stops.held_len(context), len(text))
            if hold:
                pending = text[len(text) - hold :]
                text = text[: len(text) - hold]
        if stops.max_len > 1:
            tail = context[1 - stops.max_len :]
    full, stable = wt.full, wt.stable
    context_len = wt.base - ts.extra
    if stable == len(full) and (detok.context_free or len(full) > context_len):
        # A clean boundary: the window becomes the next step's context (none if byte-level).
        return text, ((end if detok.context_free else ts.read_offset), end, 0, tail, pending)
    return text, (ts.prefix_offset, ts.read_offset, max(ts.extra, stable - context_len), tail,
                  pending)
