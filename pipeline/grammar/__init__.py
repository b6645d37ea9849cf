"""Grammar-constrained output: the matcher protocol the finish rules use (`matcher`), the
llguidance backend for JSON schema / regex / choice / Lark (`llg`), and the per-stage matchers
that cut drafts and mask the verifier's logits under speculation (`tracker`)."""

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
    """A fresh matcher for `SamplingParams.grammar`: a compiled `Grammar` (built against
    `tokenizer`) or a zero-argument factory such as `choice_grammar`'s."""
    if isinstance(grammar, Grammar):
        from pipeline.grammar.llg import grammar_matcher  # llguidance: only when a grammar comes

        return grammar_matcher(grammar, tokenizer)
    return grammar()
