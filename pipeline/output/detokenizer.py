"""Incremental detokenization, batched per step, with stop-string search and hold-back.

Committed text. For output ids `ids`, let `S(p)` be `decode(ids[:p+1])` with its trailing run of
U+FFFD removed: U+FFFD at the very end may stand for a character whose bytes have not all arrived
(byte-level BPE gives one for an incomplete tail, SentencePiece byte fallback one per byte token), so
it is not final until a later character follows it. SentencePiece byte fallback decodes a run of
consecutive byte tokens as one unit: valid UTF-8, else one U+FFFD per byte, so a byte that starts a
new character can turn a run that decoded to text ("丸") back into U+FFFDs. `S(p)` therefore also
leaves out the text of a trailing run of byte tokens (until a non-byte token ends the run, or the
finish settles it). `S(p)` only grows with `p`, so it is the text the output path commits to: stop
strings are searched in it, and a stop
string completes at the first position `p` whose `S(p)` contains it (`f` = the token holding the
match's last character). At finish the text is settled: the decode of the retained ids, trailing
U+FFFD included (DESIGN.md, *Streaming*).

Per step, per request, one sequence is decoded (two for tokenizers whose decode needs context, e.g.
SentencePiece's leading-space rule: vLLM's prefix/read offsets), all requests of the step in one
`decode_batch` call per `skip_special_tokens` value. Byte-level BPE decoders (GPT-2, SmolLM2, Llama 3)
decode concatenatively at character boundaries, so they need no context and the window is just the
tokens since the last clean boundary: the cost of a step does not depend on the output length.

Stop strings are searched only in the new committed text plus the `max_len - 1` committed characters
before it (`TextState.tail`); the token holding a match's last character is found by a binary search
over decodes of the window's prefixes, done only when a match is found.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.output.request_state import TextState

REPLACEMENT = "\ufffd"


def stable_len(full: str) -> int:
    """Length of `full` without its trailing U+FFFD run (maybe a character still missing bytes)."""
    return len(full.rstrip(REPLACEMENT)) if full.endswith(REPLACEMENT) else len(full)


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


@dataclass(slots=True)
class DecodedWindow:
    """One request's decode this step: `full = decode(ids[prefix:end])`, `base` = committed chars of
    it before this step (context text + `extra`)."""

    full: str
    base: int

    @property
    def committed(self) -> str:
        """Text newly committed by this window (trailing U+FFFD held back)."""
        stable = stable_len(self.full)
        return self.full[self.base : stable] if stable > self.base else ""


class Detokenizer:
    """Batch decoding over a Hugging Face tokenizer (fast or slow) or a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Any, context_free: bool | None = None) -> None:
        self.tokenizer = tokenizer
        backend = _backend(tokenizer)
        self._backend = backend
        cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        # The Rust decode_batch is one call for the whole batch; fall back to the tokenizer's own
        # batch_decode when it post-processes text (clean-up) or there is no Rust backend.
        self._native = backend is not None and (not cleanup or backend is tokenizer)
        self.special_ids = _special_ids(tokenizer, backend)
        if context_free is None:
            context_free = _is_byte_level(backend)
        self.context_free = context_free
        # <0xNN> tokens of a byte-fallback decoder (empty otherwise): see the module docstring.
        self.byte_tokens = _byte_fallback_ids(backend)

    def trailing_byte_run(self, seq: Sequence[int]) -> int:
        """How many byte-fallback tokens end `seq` (0 for other tokenizers)."""
        byte_tokens = self.byte_tokens
        n = 0
        for t in reversed(seq):
            if t not in byte_tokens:
                break
            n += 1
        return n

    def decode_batch(self, seqs: list[list[int]], skip: list[bool]) -> list[str]:
        """Decode every sequence; one call per distinct `skip_special_tokens` value."""
        if not seqs:
            return []
        first = skip[0]
        if all(s == first for s in skip):
            return self._decode_batch(seqs, first)
        out: list[str] = [""] * len(seqs)
        for flag in (False, True):
            idx = [i for i, s in enumerate(skip) if s == flag]
            for i, text in zip(idx, self._decode_batch([seqs[i] for i in idx], flag)):
                out[i] = text
        return out

    def decode(self, ids: list[int], skip: bool) -> str:
        return self._decode_batch([ids], skip)[0]

    def _decode_batch(self, seqs: list[list[int]], skip: bool) -> list[str]:
        if self._native:
            return self._backend.decode_batch(seqs, skip_special_tokens=skip)
        return self.tokenizer.batch_decode(seqs, skip_special_tokens=skip)

    # -- one request's text, step by step -------------------------------------------------------

    def sequences(self, ts: TextState, ids: Sequence[int], window: list[int]) -> list[list[int]]:
        """What to decode for this step: the window since `prefix_offset` (plus the context alone
        when the tokenizer needs context)."""
        seq = list(ids[ts.prefix_offset :]) + window
        if self.context_free:
            return [seq]
        return [seq, list(ids[ts.prefix_offset : ts.read_offset])]

    def window(self, ts: TextState, texts: list[str]) -> DecodedWindow:
        """The decode results of `sequences` as a DecodedWindow."""
        context = len(texts[1]) if len(texts) > 1 else 0
        return DecodedWindow(texts[0], context + ts.extra)

    def advance(
        self, ts: TextState, full: str, base: int, stable: int, end: int
    ) -> tuple[int, int, int]:
        """(prefix_offset, read_offset, extra) after committing `full[base:stable]` of this step's
        decode `full`; the ids now end at `end`."""
        context = base - ts.extra  # chars of decode(ids[prefix:read])
        if stable == len(full) and (self.context_free or len(full) > context):
            # A clean boundary: everything is committed. vLLM keeps the window as the next step's
            # context; a byte-level decoder needs none.
            return (end if self.context_free else ts.read_offset), end, 0
        return ts.prefix_offset, ts.read_offset, max(ts.extra, stable - context)

    def first_stop(
        self,
        ts: TextState,
        ids: Sequence[int],
        window: list[int],
        dw: DecodedWindow,
        stops: StopStrings,
        hit: tuple[int, int, str],
        min_pos: int,
        skip: bool,
    ) -> tuple[int, tuple[int, int, str]] | None:
        """Starting from `hit`, the first match in `ts.tail + dw.committed` (see StopStrings.find)
        whose last character's token is at an output position >= `min_pos`, as
        (position, (start, end, stop)), or None. Matches before min_new_tokens are skipped."""
        context = ts.tail + dw.committed
        start = len(ids)
        while hit is not None:
            pos = start + self.locate(ts, ids, window, dw, hit[1] - len(ts.tail), skip) - 1
            if pos >= min_pos:
                return pos, hit
            hit = stops.find(context, hit[1])
        return None

    def locate(
        self,
        ts: TextState,
        ids: Sequence[int],
        window: list[int],
        dw: DecodedWindow,
        chars: int,
        skip: bool,
    ) -> int:
        """Smallest k such that the first k window tokens commit at least `chars` new characters
        (binary search over decodes; called only when a stop string matched)."""
        head = list(ids[ts.prefix_offset :])
        lo, hi = 1, len(window)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.committed_len(head + window[:mid], skip) - dw.base >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def committed_len(self, seq: list[int], skip: bool) -> int:
        """Characters of `decode(seq)` committed: all but a trailing U+FFFD run and the text of a
        trailing byte-fallback run (the rule the output path applies per step)."""
        stable = stable_len(self.decode(seq, skip))
        run = self.trailing_byte_run(seq) if self.byte_tokens else 0
        if run:
            stable = min(stable, len(self.decode(seq[: len(seq) - run], skip)))
        return stable


def _backend(tokenizer: Any) -> Any:
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        return None
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, tokenizers.Tokenizer) else None


def _special_ids(tokenizer: Any, backend: Any) -> frozenset[int]:
    ids: set[int] = set()
    if backend is not None:
        ids.update(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
    ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
    return frozenset(ids)


def _is_byte_level(backend: Any) -> bool:
    if backend is None:
        return False
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_fallback_ids(backend: Any) -> frozenset[int]:
    if backend is None or backend.decoder is None:
        return frozenset()
    if '"ByteFallback"' not in json.dumps(json.loads(backend.decoder.__getstate__())):
        return frozenset()
    return frozenset(i for piece, i in backend.get_vocab().items() if _BYTE_PIECE.fullmatch(piece))
