"""A stage's grammar matchers, advanced only by the plan's `commits`: every copy has consumed the
same output before a step. A token a copy rejects (a request its grammar finished, still in one
overlapped step) kills it: the request is ending, and its rows go unconstrained."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeline.params import Grammar
from pipeline.protocol import StepPlan


class GrammarTracker:
    """`tokenizer` is called once, at the first constrained request (no cost without one)."""

    def __init__(self, tokenizer: Callable[[], Any]) -> None:
        self._load_tokenizer = tokenizer
        self._tokenizer: Any = None
        self._matchers: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def reset(self) -> None:
        self._matchers.clear()

    def apply(self, plan: StepPlan) -> None:
        for rid in plan.release:
            self._matchers.pop(rid, None)
        for new in plan.new:
            # Compiled grammars only: a test's factory constrains the output stage alone.
            if isinstance(new.params.grammar, Grammar):
                m = self._matchers[new.rid] = self._new_matcher(new.params.grammar)
                # A preempted request comes back with its output so far in its prompt.
                for t in new.prompt_ids[len(new.prompt_ids) - new.num_output:]:
                    if not m.accept_token(t):
                        break
        if not self._matchers:
            return
        for rid, tokens in plan.commits.items():
            m = self._matchers.get(rid)
            if m is not None and not m.is_dead():
                for t in tokens:
                    if not m.accept_token(t):
                        break

    def cut(self, rids: Sequence[str], drafts: list[list[int]]) -> list[list[int]]:
        if not self._matchers:
            return drafts
        out = []
        for rid, d in zip(rids, drafts):
            m = self._matchers.get(rid)
            out.append(d if m is None or not d or m.is_dead() else d[: m.valid_prefix(d)])
        return out

    def masks(self, rids: Sequence[str], drafts: Sequence[Sequence[int]], width: int,
              vocab_size: int) -> np.ndarray | None:
        """bool [B, width, vocab], all True for unconstrained rows; None when no row has one."""
        if not any(rid in self._matchers for rid in rids):
            return None
        out = np.ones((len(rids), width, vocab_size), dtype=bool)
        for i, (rid, d) in enumerate(zip(rids, drafts)):
            m = self._matchers.get(rid)
            if m is not None:
                rows = m.masks(d, vocab_size)
                out[i, : rows.shape[0]] = rows
        return out

    def _new_matcher(self, grammar: Grammar) -> Any:
        from pipeline.grammar.llg import grammar_matcher

        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return grammar_matcher(grammar, self._tokenizer)
