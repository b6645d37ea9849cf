"""The llguidance backend: JSON schema, regex, choice and Lark grammars. A `Grammar` is plain
data (the compiled text) in `SamplingParams`; each stage builds matchers against its own
tokenizer. `compile_grammar` refuses what it can see; what a matcher meets later is an error."""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from pipeline.grammar.memory import BYTES_PER_CHAR, MEMORY, Entry, rss_bytes
from pipeline.grammar.schema_check import no_finite_instance
from pipeline.params import GRAMMAR_KINDS, Grammar
from pipeline.tiny_tokenizer import ByteTokenizer
from pipeline.tokenizer import eos_token_ids

JSON_OPTIONS = {"whitespace_flexible": False}
MAX_GRAMMAR_CHARS = 64 << 10

PROBE_TOKENS = 4  # tokens matched at compile time to meet limits hit after the first one
# Terse errors: they reach clients.
LIMITS = LLParserLimits(verbose_errors=False)

# Building one LLTokenizer takes ~1 s for a 50k vocabulary.
_LLTOKENIZERS: weakref.WeakKeyDictionary[Any, LLTokenizer] = weakref.WeakKeyDictionary()


def lltokenizer(tokenizer: Any) -> LLTokenizer:
    cached = _LLTOKENIZERS.get(tokenizer)
    if cached is None:
        cached = _LLTOKENIZERS[tokenizer] = _build_lltokenizer(tokenizer)
    return cached


def _build_lltokenizer(tokenizer: Any) -> LLTokenizer:
    try:
        eos = eos_token_ids(tokenizer)
    except AttributeError:
        eos = [tokenizer.eos_token_id]
    if hasattr(tokenizer, "backend_tokenizer") and not isinstance(tokenizer, ByteTokenizer):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
    from llguidance._tokenizer import TokenizerWrapper

    return LLTokenizer(TokenizerWrapper(_ByteVocab(tokenizer)), eos_token=eos)


class _ByteVocab:
    """Token bytes per id (special ones after a 0xFF, llguidance's convention) and an encoder."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = list(getattr(tokenizer, "all_special_ids", [self.eos_token_id]))
        special = set(self.special_token_ids)
        decode = tokenizer.decode
        self.tokens = [b"\xff" + decode([i], skip_special_tokens=False).encode() if i in special
                       else decode([i]).encode() for i in range(len(tokenizer))]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text)


def grammar_matcher(grammar: Grammar, tokenizer: Any) -> LLGuidanceMatcher:
    if tokenizer is None:
        raise ValueError("grammar: a grammar-constrained request needs a tokenizer")
    lltok = lltokenizer(tokenizer)
    # Building a matcher parses the grammar (ms); a copy is cheap.
    template, entry = MEMORY.acquire((id(lltok), grammar.compiled),
                                     lambda: LLMatcher(lltok, grammar.compiled, log_level=0,
                                                       limits=LIMITS), owner=lltok)
    return LLGuidanceMatcher(template.deep_copy(), entry)


def compile_grammar(kind: str, source: Any, tokenizer: Any) -> Grammar:
    """ValueError naming the problem, including when no output of `tokenizer` can satisfy it."""
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"grammar: unknown kind {kind!r} (one of {', '.join(GRAMMAR_KINDS)})")
    text = source if isinstance(source, str) else json.dumps(source)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{kind}: longer than {MAX_GRAMMAR_CHARS} characters")
    if kind == "choice" and (not isinstance(source, list) or not source
                             or not all(isinstance(s, str) and s for s in source)):
        raise ValueError("choice: must be a non-empty list of non-empty strings")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{kind}: not JSON: {e}") from None
        reason = no_finite_instance(schema)
        if reason is not None:
            raise ValueError(f"{kind}: {reason}")
    try:
        if kind == "json_schema":  # no free whitespace: small models loop on it
            compiled = LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        else:
            compiled = llguidance.grammar_from(kind, text)  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise ValueError(f"{kind}: {e}") from None
    lltok = lltokenizer(tokenizer)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(compiled, lltok, limits=LIMITS)
    if is_error:
        raise ValueError(f"{kind}: {_first_line(messages[0] if messages else '')}")
    with MEMORY.measuring() as grown:
        problem = _probe(LLMatcher(lltok, compiled, log_level=0, limits=LIMITS), lltok.vocab_size)
    if problem is not None:
        raise ValueError(f"{kind}: {problem}")
    size = max(grown[0], len(compiled) * BYTES_PER_CHAR)
    if size > MEMORY.budget:
        raise ValueError(f"{kind}: the compiled grammar needs about {size >> 20} MB, over this "
                         f"server's grammar memory budget of {MEMORY.budget >> 20} MB")
    return Grammar(kind, compiled)


NO_OUTPUT = "no output of this tokenizer can satisfy the grammar"
_TERSE = {"NoExtensionBias": "a dead end: no token of this tokenizer can continue the output",
          "NoExtension": "a dead end: no token of this tokenizer can continue the output"}


def _probe(matcher: LLMatcher, vocab_size: int) -> str | None:
    """Why the grammar cannot be used, or None: llguidance meets most of its limits only once
    matching starts, so one path of PROBE_TOKENS tokens is matched."""
    for step in range(PROBE_TOKENS + 1):
        mask = matcher.compute_bitmask()
        if matcher.is_error():
            error = _first_line(matcher.get_error())
            return NO_OUTPUT if step == 0 and error in _TERSE.values() else error
        if matcher.is_stopped():
            return None if matcher.is_accepting() or step else NO_OUTPUT
        if step == PROBE_TOKENS:
            return None
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab_size]
        allowed = np.flatnonzero(bits)
        if not len(allowed):
            return NO_OUTPUT
        if not matcher.consume_token(int(allowed[len(allowed) // 2])):
            return _first_line(matcher.get_error())
    return None


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines()
             if ln.strip() and not ln.strip().startswith("<")]  # "<non-verbose/>", "<state>"
    text = " ".join(lines[:4])[:300] or "invalid grammar"
    return _TERSE.get(text, text)


class LLGuidanceMatcher:
    """A GrammarMatcher plus what speculation needs. Once dead (a rejected token, a dead end, a
    limit) `masks` allows every token, never a hang: the output stage's matcher meets the same
    error and ends the request. Its RSS growth is charged to its grammar."""

    def __init__(self, matcher: LLMatcher, entry: Entry | None = None) -> None:
        self._m = matcher
        self._entry = entry
        if entry is not None:
            weakref.finalize(self, MEMORY.release, entry)

    def accept_token(self, token_id: int) -> bool:
        return self._m.consume_token(int(token_id))

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def is_dead(self) -> bool:
        return self._m.is_error()

    def error(self) -> str | None:
        if self._m.is_error():
            return _first_line(self._m.get_error())
        if self._m.is_stopped() and not self._m.is_accepting():
            return "the grammar stopped before the output was complete"
        return None

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        if self._m.is_error() or not tokens:
            return 0
        before = rss_bytes()
        n = self._m.validate_tokens(list(tokens))
        self._charge(before)
        return n

    def _charge(self, before: int) -> None:
        if self._entry is not None:
            MEMORY.charge(self._entry, rss_bytes() - before)

    def masks(self, drafts: Sequence[int], vocab_size: int) -> np.ndarray:
        """Row j: tokens allowed after j drafts (all, past a rejected one); ends where it began."""
        out = np.ones((len(drafts) + 1, vocab_size), dtype=bool)
        if self.is_dead():
            return out
        before = rss_bytes()
        n = self._m.validate_tokens(list(drafts)) if drafts else 0
        for j in range(n + 1):
            row = self._mask_row(vocab_size)
            if row is None:
                break
            out[j] = row
            if j < n:
                self._m.consume_token(int(drafts[j]))
        self._m.rollback(min(n, j))
        self._charge(before)
        return out

    def _mask_row(self, vocab_size: int) -> np.ndarray | None:
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8),
                             bitorder="little").astype(bool)
        if self._m.is_error():
            return None
        row = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, bits.shape[0])
        row[:n] = bits[:n]
        return row if row.any() else None
