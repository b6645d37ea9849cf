"""The llguidance grammar backend: JSON schema, regex, choice and Lark grammars over our tokenizers.

llguidance (a Rust wheel with no Python dependencies; vLLM's and llama.cpp's backend) compiles a
grammar once and matches it token by token with an Earley parser over a token trie: the mask for
the next token costs well under a millisecond, `rollback(n)` undoes consumed tokens, and
`validate_tokens` checks a draft without consuming it, which is what speculation needs.

A `Grammar` is plain data (the compiled grammar text), so it travels inside `SamplingParams` to
every stage (pickled by Ray); each stage builds its own matchers against its own tokenizer
(`Grammar.matcher(tokenizer)`), the LLTokenizer built once per tokenizer object.
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from pipeline.tiny_tokenizer import ByteTokenizer
from pipeline.tokenizer import eos_token_ids

GRAMMAR_KINDS = ("json_schema", "regex", "choice", "lark")
JSON_OPTIONS = {"whitespace_flexible": False}  # separators "," and ":", no free whitespace
MAX_GRAMMAR_CHARS = 64 << 10  # one request's grammar source; bigger ones are refused

# One LLTokenizer per tokenizer object (building one takes ~1 s for a 50k vocabulary).
_LLTOKENIZERS: weakref.WeakKeyDictionary[Any, LLTokenizer] = weakref.WeakKeyDictionary()
# Per tokenizer, fresh matchers of the most recently used grammars (requests repeat schemas).
_TEMPLATES: weakref.WeakKeyDictionary[Any, OrderedDict[str, LLMatcher]] = (
    weakref.WeakKeyDictionary())
MAX_TEMPLATES = 256


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


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar (llguidance's grammar text) and what it was made from (for messages).

    Not a zero-argument factory like `choice_grammar`: matchers need the stage's tokenizer."""

    kind: str  # one of GRAMMAR_KINDS
    compiled: str

    def matcher(self, tokenizer: Any) -> LLGuidanceMatcher:
        if tokenizer is None:
            raise ValueError("grammar: a grammar-constrained request needs a tokenizer")
        templates = _TEMPLATES.setdefault(tokenizer, OrderedDict())
        template = templates.get(self.compiled)
        if template is None:  # building a matcher parses the grammar (ms); a copy is cheap
            template = templates[self.compiled] = LLMatcher(lltokenizer(tokenizer), self.compiled,
                                                            log_level=0)
            if len(templates) > MAX_TEMPLATES:
                templates.popitem(last=False)
        else:
            templates.move_to_end(self.compiled)
        return LLGuidanceMatcher(template.deep_copy())


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
    try:
        if kind == "json_schema":  # compact JSON: free whitespace lets small models loop on it
            compiled = LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        else:
            compiled = llguidance.grammar_from(kind, text)  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise ValueError(f"{kind}: {e}") from None
    lltok = lltokenizer(tokenizer)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(compiled, lltok)
    if is_error:
        raise ValueError(f"{kind}: {_first_line(messages[0] if messages else '')}")
    matcher = LLMatcher(lltok, compiled, log_level=0)
    if matcher.is_error():
        raise ValueError(f"{kind}: {_first_line(matcher.get_error())}")
    matcher.compute_bitmask()  # the parser settles its first state here
    if matcher.is_stopped() and not matcher.is_accepting():
        raise ValueError(f"{kind}: no output of this tokenizer can satisfy the grammar")
    return Grammar(kind, compiled)


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return " ".join(lines[:4])[:300] or "invalid grammar"


class LLGuidanceMatcher:
    """One request's matcher: the GrammarMatcher protocol (`accept_token`, `is_terminated`) plus
    what speculation needs (`valid_prefix`, `masks` along a draft path, `rollback`).

    After a rejected token the matcher is dead: it accepts nothing and terminates, and `masks`
    allows every token (the request is ending; never an all-masked row)."""

    def __init__(self, matcher: LLMatcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._m.consume_token(int(token_id))

    def is_terminated(self) -> bool:
        return self._m.is_stopped()  # also true in the error state

    def is_dead(self) -> bool:
        return self._m.is_error()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar allows from here, in order (consumes nothing)."""
        if self._m.is_error() or not tokens:
            return 0
        return self._m.validate_tokens(list(tokens))

    def masks(self, drafts: Sequence[int], vocab_size: int) -> np.ndarray:
        """bool [len(drafts) + 1, vocab_size]: the tokens allowed at each position of the draft
        path (row j: after the first j drafts). Rows past the first draft the grammar rejects
        allow everything (acceptance stops there). The matcher ends where it started."""
        out = np.ones((len(drafts) + 1, vocab_size), dtype=bool)
        if self._m.is_error():
            return out
        n = self.valid_prefix(drafts)
        for j in range(n + 1):
            out[j] = self._mask_row(vocab_size)
            if j < n:
                self._m.consume_token(int(drafts[j]))
        self._m.rollback(n)
        return out

    def _mask_row(self, vocab_size: int) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8),
                             bitorder="little").astype(bool)
        row = np.zeros(vocab_size, dtype=bool)  # model ids past the tokenizer's: never allowed
        n = min(vocab_size, bits.shape[0])
        row[:n] = bits[:n]
        if not row.any():  # a dead end the tokenizer cannot leave: unconstrained, never a hang
            row[:] = True
        return row
