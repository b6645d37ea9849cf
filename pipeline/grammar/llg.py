"""The llguidance grammar backend: JSON schema, regex, choice and Lark grammars over our tokenizers.

llguidance (a Rust wheel with no Python dependencies; vLLM's and llama.cpp's backend) compiles a
grammar once and matches it token by token with an Earley parser over a token trie: the mask for
the next token costs well under a millisecond, `rollback(n)` undoes consumed tokens, and
`validate_tokens` checks a draft without consuming it, which is what speculation needs.

A `Grammar` (pipeline.params) is plain data (the compiled grammar text), so it travels inside
`SamplingParams` to every stage (the protocol encodes it; decoding it needs no llguidance); each
stage builds its own matchers against its own tokenizer (`grammar_matcher(grammar, tokenizer)`),
the LLTokenizer built once per tokenizer object, the compiled templates kept under a byte budget
(`pipeline.grammar.memory`).

Dead ends. `compile_grammar` refuses what it can see: invalid sources, llguidance's limits hit
while the first tokens are matched (a short probe: "too many expressions constructed", "row has
N items; max is 2000"), JSON schemas no finite value satisfies (`schema_check`) and grammars
over the memory budget. A limit or dead end met later puts the matcher in an error state
(`LLGuidanceMatcher.error`), and the output stage ends the request with an error, never `stop`.
"""

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

JSON_OPTIONS = {"whitespace_flexible": False}  # separators "," and ":", no free whitespace
MAX_GRAMMAR_CHARS = 64 << 10  # one request's grammar source; bigger ones are refused

PROBE_TOKENS = 4  # tokens matched at compile time to meet limits hit after the first one
# llguidance's default limits; errors without the parser state and grammar (they reach clients)
LIMITS = LLParserLimits(verbose_errors=False)

# One LLTokenizer per tokenizer object (building one takes ~1 s for a 50k vocabulary).
_LLTOKENIZERS: weakref.WeakKeyDictionary[Any, LLTokenizer] = weakref.WeakKeyDictionary()


def lltokenizer(tokenizer: Any) -> LLTokenizer:
    """The LLTokenizer for an HF fast tokenizer or the tiny ByteTokenizer (cached per object)."""
    cached = _LLTOKENIZERS.get(tokenizer)
    if cached is None:
        cached = _LLTOKENIZERS[tokenizer] = _build_lltokenizer(tokenizer)
    return cached


def _build_lltokenizer(tokenizer: Any) -> LLTokenizer:
    try:
        eos = eos_token_ids(tokenizer)
    except AttributeError:  # a minimal tokenizer (test fakes): its one EOS
        eos = [tokenizer.eos_token_id]
    if hasattr(tokenizer, "backend_tokenizer") and not isinstance(tokenizer, ByteTokenizer):
        import llguidance.hf  # an HF fast tokenizer: its Rust tokenizer as JSON

        return llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
    from llguidance._tokenizer import TokenizerWrapper  # a per-id vocabulary (tiny, test fakes)

    return LLTokenizer(TokenizerWrapper(_ByteVocab(tokenizer)), eos_token=eos)


class _ByteVocab:
    """The tiny tokenizer as llguidance's TokenizerWrapper expects it: token bytes per id
    (special tokens marked by a leading 0xFF, llguidance's convention) and an encoder."""

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
    """A fresh matcher of `grammar` over `tokenizer`; it holds a reference on the process's
    template until dropped."""
    if tokenizer is None:
        raise ValueError("grammar: a grammar-constrained request needs a tokenizer")
    lltok = lltokenizer(tokenizer)
    # building a matcher parses the grammar (ms); a copy is cheap
    template, entry = MEMORY.acquire((id(lltok), grammar.compiled),
                                     lambda: LLMatcher(lltok, grammar.compiled, log_level=0,
                                                       limits=LIMITS), owner=lltok)
    return LLGuidanceMatcher(template.deep_copy(), entry)


def compile_grammar(kind: str, source: Any, tokenizer: Any) -> Grammar:
    """Compile and check a grammar against `tokenizer`; ValueError naming the problem when the
    source is invalid or the tokenizer cannot produce any output the grammar allows.

    `source`: a JSON schema (dict or JSON text) for json_schema, a regex, a list of strings for
    choice, or Lark text."""
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
        if kind == "json_schema":  # compact JSON: free whitespace lets small models loop on it
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
# llguidance's terse stop reasons, in words a client can act on
_TERSE = {"NoExtensionBias": "a dead end: no token of this tokenizer can continue the output",
          "NoExtension": "a dead end: no token of this tokenizer can continue the output"}


def _probe(matcher: LLMatcher, vocab_size: int) -> str | None:
    """Why the grammar cannot be used (an error in its first PROBE_TOKENS tokens along one path,
    or no output the tokenizer can produce), or None. llguidance meets most of its limits only
    when matching starts ("too many expressions constructed", "row has N items")."""
    for step in range(PROBE_TOKENS + 1):
        mask = matcher.compute_bitmask()  # the parser settles each state here
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
        if not matcher.consume_token(int(allowed[len(allowed) // 2])):  # one path in the middle
            return _first_line(matcher.get_error())
    return None


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines()
             if ln.strip() and not ln.strip().startswith("<")]  # "<non-verbose/>", "<state>"
    text = " ".join(lines[:4])[:300] or "invalid grammar"
    return _TERSE.get(text, text)


class LLGuidanceMatcher:
    """One request's matcher: the GrammarMatcher protocol (`accept_token`, `is_terminated`) plus
    what speculation needs (`valid_prefix`, `masks` along a draft path, `rollback`).

    After a rejected token, a dead end (no token allowed) or an llguidance limit the matcher is
    dead: it accepts nothing, terminates, `error()` says why, and `masks` allows every token (no
    all-masked row, never a hang): the output stage's own matcher meets the same error on the
    same tokens and ends the request with it.

    Holds a reference on its grammar's template (`pipeline.grammar.memory`) until dropped, and
    charges the process's RSS growth while it computes masks or checks drafts to that grammar."""

    def __init__(self, matcher: LLMatcher, entry: Entry | None = None) -> None:
        self._m = matcher
        self._entry = entry
        if entry is not None:
            weakref.finalize(self, MEMORY.release, entry)

    def accept_token(self, token_id: int) -> bool:
        return self._m.consume_token(int(token_id))

    def is_terminated(self) -> bool:
        return self._m.is_stopped()  # also true in the error state

    def is_dead(self) -> bool:
        return self._m.is_error()

    def error(self) -> str | None:
        """Why the output cannot be completed (a rejected token, a dead end, an llguidance
        limit), or None while it can (or the grammar accepted it)."""
        if self._m.is_error():
            return _first_line(self._m.get_error())
        if self._m.is_stopped() and not self._m.is_accepting():
            return "the grammar stopped before the output was complete"
        return None

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar allows from here, in order (consumes nothing)."""
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
        """bool [len(drafts) + 1, vocab_size]: the tokens allowed at each position of the draft
        path (row j: after the first j drafts). Rows past the first draft the grammar rejects
        allow everything (acceptance stops there). The matcher ends where it started."""
        out = np.ones((len(drafts) + 1, vocab_size), dtype=bool)
        if self.is_dead():
            return out
        before = rss_bytes()
        n = self._m.validate_tokens(list(drafts)) if drafts else 0  # charged once, below
        for j in range(n + 1):
            row = self._mask_row(vocab_size)
            if row is None:  # a dead end at row j: the rows from there on are unconstrained
                break
            out[j] = row
            if j < n:
                self._m.consume_token(int(drafts[j]))
        self._m.rollback(min(n, j))
        self._charge(before)
        return out

    def _mask_row(self, vocab_size: int) -> np.ndarray | None:
        """The allowed tokens here, or None at a dead end (an llguidance error, or no token the
        model can produce is allowed)."""
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8),
                             bitorder="little").astype(bool)
        if self._m.is_error():
            return None
        row = np.zeros(vocab_size, dtype=bool)  # model ids past the tokenizer's: never allowed
        n = min(vocab_size, bits.shape[0])
        row[:n] = bits[:n]
        return row if row.any() else None
