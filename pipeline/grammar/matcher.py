"""Grammar matchers for constrained output: the protocol the finish rules use, and a small real one.

`SamplingParams.grammar` is a zero-argument factory; the output processor calls it once per request
for a fresh matcher and feeds it every retained output token, in order, exactly once.

The grammar finish condition holds at the first token after which the matcher accepts no more
tokens: `is_terminated()` is true after accepting it, or the matcher rejected it
(`accept_token` returned False). Only the first is a finish the grammar accepted (`stop`). A
rejected token, a dead end or a matcher's internal limit (`grammar_error` says which) ends the
request at that token with an error: the output cannot be completed, and a client must be able to
tell it from a real answer. With a token-masking verifier a rejected token means a dead end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class GrammarMatcher(Protocol):
    """Incremental matcher over output token ids (the xgrammar / llguidance matcher shape)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False when the grammar does not allow it here."""
        ...

    def is_terminated(self) -> bool:
        """True when the grammar accepts no more tokens."""
        ...

    # Optional: `error() -> str | None`, why the output cannot be completed (see grammar_error).


class TokenSequenceMatcher:
    """Accepts exactly one of a fixed set of token sequences (a choice grammar).

    Terminates once the tokens so far form a complete sequence that no other sequence extends.
    """

    def __init__(self, sequences: Iterable[Sequence[int]]) -> None:
        seqs = [tuple(int(t) for t in s) for s in sequences]
        if not seqs or any(not s for s in seqs):
            raise ValueError("grammar: needs at least one non-empty token sequence")
        self._complete = frozenset(seqs)
        self._prefixes = frozenset(s[:k] for s in seqs for k in range(len(s) + 1))
        self._extendable = frozenset(s[:k] for s in seqs for k in range(len(s)))
        self._prefix: tuple[int, ...] = ()
        self._dead = False

    def accept_token(self, token_id: int) -> bool:
        if self.is_terminated():
            return False
        nxt = self._prefix + (int(token_id),)
        if nxt not in self._prefixes:
            self._dead = True
            return False
        self._prefix = nxt
        return True

    def is_terminated(self) -> bool:
        if self._dead:
            return True
        return self._prefix in self._complete and self._prefix not in self._extendable

    def error(self) -> str | None:
        return "a token the grammar does not allow" if self._dead else None


def choice_grammar(sequences: Iterable[Sequence[int]]) -> Callable[[], TokenSequenceMatcher]:
    """A `SamplingParams.grammar` factory: each call returns a fresh TokenSequenceMatcher."""
    seqs = [tuple(s) for s in sequences]
    TokenSequenceMatcher(seqs)  # validate now, not at the first request

    def factory() -> TokenSequenceMatcher:
        return TokenSequenceMatcher(seqs)

    return factory


def grammar_error(matcher: GrammarMatcher) -> str | None:
    """Why `matcher` ended without accepting the output (a rejected token, a dead end, an
    internal limit), or None when it accepted it. A matcher without `error()` that rejected a
    token reports that."""
    error = getattr(matcher, "error", None)
    if error is not None:
        return error()
    return None


def grammar_end(matcher: GrammarMatcher, window: Sequence[int]) -> int | None:
    """Feed `window` to `matcher` up to the first token that ends the grammar; its index, or None.

    Tokens after that index are not fed (the request ends there)."""
    for i, t in enumerate(window):
        if not matcher.accept_token(t) or matcher.is_terminated():
            return i
    return None
