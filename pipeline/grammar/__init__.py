"""Grammar-constrained output: the matcher protocol (`matcher`), the llguidance backend (`llg`),
and the per-stage matchers that cut drafts and mask logits under speculation (`tracker`)."""

from __future__ import annotations

from typing import Any

from pipeline.grammar.matcher import (
    GrammarMatcher,
    TokenSequenceMatcher,
    choice_grammar,
    grammar_end,
    grammar_error,
)
from pipeline.params import Grammar

__all__ = ["GrammarMatcher", "TokenSequenceMatcher", "choice_grammar", "grammar_end",
           "grammar_error", "new_matcher"]


def new_matcher(grammar: Any, tokenizer: Any) -> Any:
    """`grammar`: a compiled `Grammar`, or a zero-argument factory such as `choice_grammar`'s."""
    if isinstance(grammar, Grammar):
        from pipeline.grammar.llg import grammar_matcher

        return grammar_matcher(grammar, tokenizer)
    return grammar()
