"""A request's text, step by step: what is decoded, which of it is committed, where a stop string
completes, and what is held back. Every text rule of the output path lives here, once.

**Committed text.** For output ids `ids`, let `S(p)` be `decode(ids[:p+1])` less two kinds of tail:
- its trailing run of U+FFFD: U+FFFD at the very end may stand for a character whose bytes have not
  all arrived (byte-level BPE gives one for an incomplete tail, SentencePiece byte fallback one per
  byte token), so it is not final until a later character follows it;
- the text of a trailing run of SentencePiece byte-fallback tokens: byte fallback decodes a run of
  consecutive byte tokens as one unit (valid UTF-8, else one U+FFFD per byte), so a byte that starts
  a new character can turn a run that decoded to text ("丸") back into U+FFFDs. The run's text is
  committed once a non-byte token ends the run.
`S(p)` only grows with `p`. Stop strings are searched in it, at every position (a finish included),
and a stop string completes at the first position `p` whose `S(p)` contains it (`f` = the token
holding the match's last character; `min_new_tokens` skips earlier completions, see
`pipeline.output.finish`). At finish the text is settled: the decode of the retained ids, trailing
U+FFFD and byte runs included (docs/contracts.md, *Streaming*).

**Hold-back.** Of the committed text, a suffix that could still become the start of a stop string is
held back (`TextState.pending`) until a later step resolves it: released, or dropped by a match.

**Cost.** Per step, per request, one sequence is decoded (two for tokenizers whose decode needs
context, e.g. SentencePiece's leading-space rule: vLLM's prefix/read offsets; one more while a
byte-fallback run is trailing), all requests of the step in one `decode_batch` call per
`skip_special_tokens` value. Byte-level BPE decoders (GPT-2, SmolLM2, Llama 3) decode concatenatively
at character boundaries, so they need no context and the window is just the tokens since the last
clean boundary: the cost of a step does not depend on the output length. Stop strings are searched
only in the new committed text plus the `max_len - 1` committed characters before it
(`TextState.tail`); the token holding a match's last character is found by a binary search over
decodes of the window's prefixes, done only when a match is found.
"""

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
# (state, retained output ids before this step, this step's tokens whose text counts (a finish may
# have cut them), skip_special_tokens): what `decode_windows` needs of one request
TextRequest = tuple["TextState", array, list[int], bool]


@dataclass(slots=True)
class TextState:
    """Incremental detokenization of one request (vLLM-style offsets into `output_ids`).

    Text of the window `output_ids[prefix_offset:]` is decoded each step; `prefix_offset..
    read_offset` is context already turned into text (`decode(ids[prefix:read])`, empty for
    byte-level tokenizers, which need no context). `extra` counts committed characters of the
    window beyond that context text. Everything emitted + `pending` == the committed text.
    """

    prefix_offset: int = 0
    read_offset: int = 0
    extra: int = 0
    tail: str = ""  # last (max stop length - 1) committed chars: context for the stop search
    pending: str = ""  # committed text held back: it could be the start of a stop string

    def apply(self, update: TextUpdate) -> None:
        self.prefix_offset, self.read_offset, self.extra, self.tail, self.pending = update


# -- stop strings ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StopStrings:
    """A request's stop strings, prepared for the incremental search (build() caches them, so
    requests with the same stop strings share one)."""

    stops: tuple[str, ...]
    max_len: int
    last_char_re: re.Pattern  # any last character of a stop string: a match ends on one of them
    # character c -> (k, s) for every proper prefix s[:k] ending in c, longest first
    by_last: dict[str, tuple[tuple[int, str], ...]]

    @staticmethod
    def build(stops: Sequence[str]) -> StopStrings | None:
        return _build_stop_strings(tuple(dict.fromkeys(stops))) if stops else None

    def may_complete(self, new: str) -> bool:
        """False when no stop string can end inside `new` (cheap pre-check: one regex scan)."""
        return self.last_char_re.search(new) is not None

    def find(self, text: str, min_end: int) -> tuple[int, int, str] | None:
        """The occurrence in `text` with the earliest end beyond `min_end` (ties: the longest), as
        (start, end, stop string), or None. Looks at `text[min_end - max_len + 1:]` only."""
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
        """Length of the longest suffix of `text` that is a proper prefix of some stop string: text
        that must be held back because a later token could complete the stop string."""
        if not text:
            return 0
        for k, s in self.by_last.get(text[-1], ()):
            if k <= len(text) and text.endswith(s[:k]):
                return k
        return 0


@functools.lru_cache(maxsize=1024)
def _build_stop_strings(stops: tuple[str, ...]) -> StopStrings:
    # (k, s) pairs, not the prefixes themselves: no copies of long stop strings
    by_last: dict[str, list[tuple[int, str]]] = {}
    for s in stops:
        for k in range(1, len(s)):
            by_last.setdefault(s[k - 1], []).append((k, s))
    table = {c: tuple(sorted(v, key=lambda e: -e[0])) for c, v in by_last.items()}
    last = "".join(sorted({re.escape(s[-1]) for s in stops}))
    return StopStrings(stops, max(map(len, stops)), re.compile(f"[{last}]"), table)


@dataclass(frozen=True, slots=True)
class StopStringHit:
    """A stop string's completion: output position of the token holding its last character."""

    pos: int
    stop: str


@dataclass(frozen=True, slots=True)
class StopMatch:
    """Where a stop string completes: the hit, and the match's span in `TextState.tail + new`."""

    hit: StopStringHit
    start: int
    end: int


# -- one step -------------------------------------------------------------------------------------


@dataclass(slots=True)
class WindowText:
    """One request's decode this step: `full = decode(ids[prefix_offset:] + window)`; `full[:base]`
    was committed before this step, `full[:stable]` is committed after it (the committed-text
    rule), so `new = full[base:stable]` is the text this window commits."""

    window: list[int]
    full: str
    base: int
    stable: int
    new: str


def decode_windows(detok: Detokenizer, reqs: list[TextRequest]) -> list[WindowText]:
    """Decode every request's window in one batch and apply the committed-text rule (the one
    place it is computed; see the module docstring)."""
    context_free = detok.context_free
    byte_tokens = detok.byte_tokens
    seqs: list[list[int]] = []
    skips: list[bool] = []
    runs: list[int] = []  # per request: index of its decode without the trailing byte run, or -1
    for ts, ids, window, skip in reqs:
        p = ts.prefix_offset
        seq = ids[p:].tolist() + window if p < len(ids) else window
        seqs.append(seq)
        skips.append(skip)
        if not context_free:  # the context alone, right after the sequence
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
        # Committed: all but a trailing U+FFFD run, and none of a trailing byte run's text.
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
    """The first stop string completing in this window's committed text at an output position
    >= `min_pos` (earlier completions are skipped and the search goes on), or None."""
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
    """Smallest k such that the first k window tokens commit at least `chars` new characters
    (binary search over decodes; called only when a stop string matched)."""
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
    """Characters of `decode(seq)` committed (the rule as `decode_windows` applies it)."""
    return decode_windows(detok, [(TextState(), array("i"), seq, skip)])[0].stable


def stop_text(ts: TextState, wt: WindowText, match: StopMatch, include_stop: bool) -> str:
    """The last text delta of a request a stop string ends: the unsent text up to the match (or
    through it with `include_stop_str_in_output`)."""
    sent = len(ts.tail) - len(ts.pending)  # where the unsent text starts in tail + new
    cut = match.end if include_stop else match.start
    return (ts.tail + wt.new)[sent:cut]


def settled_text(ts: TextState, wt: WindowText) -> str:
    """The last text delta of a request that ends otherwise: all of the retained ids' text."""
    return ts.pending + wt.full[wt.base :]


def release(
    detok: Detokenizer, ts: TextState, wt: WindowText, stops: StopStrings | None,
    include_stop: bool, end: int,
) -> tuple[str, TextUpdate]:
    """The text delta of a request that goes on (committed text less what is held back) and its
    TextState after the step; the output ids will end at `end`."""
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
    # The offsets once `full[:stable]` is committed and the ids end at `end`.
    full, stable = wt.full, wt.stable
    context_len = wt.base - ts.extra  # chars of decode(ids[prefix:read])
    if stable == len(full) and (detok.context_free or len(full) > context_len):
        # A clean boundary: everything is committed. vLLM keeps the window as the next step's
        # context; a byte-level decoder needs none.
        return text, ((end if detok.context_free else ts.read_offset), end, 0, tail, pending)
    return text, (ts.prefix_offset, ts.read_offset, max(ts.extra, stable - context_len), tail,
                  pending)
