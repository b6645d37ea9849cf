"""The grammar matcher protocol the finish rules use, and a small real matcher. The grammar ends
at the first token it rejects or after which it terminates; only a termination it accepted is a
`stop`, anything else (`grammar_error` says what) ends the request with an error."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class GrammarMatcher(Protocol):
    """The xgrammar / llguidance matcher shape; `error() -> str | None` is optional."""

    def accept_token(self, token_id: int) -> bool:
        ...

    def is_terminated(self) -> bool:
        ...


class TokenSequenceMatcher:
    """Exactly one of a fixed set of token sequences; terminates on one no other extends."""

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
    seqs = [tuple(s) for s in sequences]
    TokenSequenceMatcher(seqs)

    def factory() -> TokenSequenceMatcher:
        return TokenSequenceMatcher(seqs)

    return factory


def grammar_error(matcher: GrammarMatcher) -> str | None:
    """Why `matcher` ended without accepting the output, or None."""
    error = getattr(matcher, "error", None)
    if error is not None:
        return error()
    return None


def grammar_end(matcher: GrammarMatcher, window: Sequence[int]) -> int | None:
    """Feed `window` up to the first token that ends the grammar; its index, or None."""
    for i, t in enumerate(window):
        if not matcher.accept_token(t) or matcher.is_terminated():
            return i
    return None
