"""A stage's grammar matchers, one per constrained request, kept in step with the plans.

The output processor's matcher (output actor) decides the finish. The draft worker (to cut drafts)
and the driver verifier (to mask logits) each hold their own copy, advanced only through the
plan's `commits`, which carry every token the request kept, in order, exactly once. So every copy
has consumed the same output before a step's drafts are cut or masked, whatever process it is in;
drafts are never consumed for good (masks roll them back). Unconstrained requests never enter.

A token the copy rejects (a request already finished by its grammar, still scheduled for one
overlapped step) kills that copy: the request is ending, and its rows go unconstrained.
"""

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
        """Forget every request's matcher."""
        self._matchers.clear()

    def apply(self, plan: StepPlan) -> None:
        """Release, register the plan's new constrained requests, feed the commits."""
        for rid in plan.release:
            self._matchers.pop(rid, None)
        for new in plan.new:
            if isinstance(new.params.grammar, Grammar):  # a compiled grammar (test factories:
                m = self._matchers[new.rid] = self._new_matcher(new.params.grammar)  # output only)
                # a preempted request comes back with its output so far: the matcher
                # consumes it again, as its commits did before
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
        """Each request's drafts up to the first token its grammar rejects."""
        if not self._matchers:
            return drafts
        out = []
        for rid, d in zip(rids, drafts):
            m = self._matchers.get(rid)
            out.append(d if m is None or not d or m.is_dead() else d[: m.valid_prefix(d)])
        return out

    def masks(self, rids: Sequence[str], drafts: Sequence[Sequence[int]], width: int,
              vocab_size: int) -> np.ndarray | None:
        """bool [B, width, vocab]: allowed tokens per request and draft-path position (all True
        for unconstrained rows); None when no request in the batch has a grammar."""
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
        from pipeline.grammar.llg import grammar_matcher  # llguidance: only when a grammar comes

        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return grammar_matcher(grammar, self._tokenizer)
