"""Finish rules (docs/contracts.md, *Finish rules (normative)*) as one pure function over a whole
window.

A step appends the window `w = [t_1..t_n]` at output positions `start..start+n-1`. `find_finish`
returns the earliest position `f` at which a condition holds, or None:

- stop token: `t` in `stop_token_ids`, or an EOS id unless `ignore_eos`, at a position
  `>= min_new_tokens` (earlier ones are ordinary tokens); an EOS id that is not also in
  `stop_token_ids` is the kind EOS (the front end reports no `stop_reason` for it);
- stop string: the earliest completion of any stop string in the committed text (`f` is the token
  holding its last character). Text is not a function of the window alone, so the caller finds it
  (`pipeline.output.text.find_stop`, which applies `min_new_tokens` below) and passes it in;
- grammar: the request's grammar accepts no more tokens after `t` (`pipeline.grammar.grammar_end`);
  when the matcher did not accept the output there (it rejected `t`, met a dead end or one of
  its internal limits: `pipeline.grammar.grammar_error`) the finish is a grammar *error*
  (reason "error", internal: the front end turns it into an error response, never a choice);
- length: position `max_new_tokens - 1`.

At one position the order is grammar error, stop token, stop string, grammar, length
(`FinishKind` order): a token the grammar rejected is never reported as a stop.
`Finish.kind_name` is the finish kind every later stage reads (`RequestOutput.finish_kind`).

`min_new_tokens` and stop strings: a stop string completing at a position `< min_new_tokens` is
ignored too (the search goes on to the next completion). The parameter promises at least that many
tokens before a *stop*, whichever kind; letting a stop string end the request earlier would break
that promise for any request that uses stop strings instead of stop ids (vLLM's `min_tokens` does
the same). Grammar and length are not stops the user can trade against `min_new_tokens`: they
apply at any position.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

from pipeline.output.text import StopStringHit
from pipeline.params import SamplingParams


class FinishKind(IntEnum):
    """Which condition ended a request; the value is the tie order at one position (EOS and
    STOP_TOKEN never tie: one token is one or the other)."""

    GRAMMAR_ERROR = -1
    EOS = 0
    STOP_TOKEN = 1
    STOP_STRING = 2
    GRAMMAR = 3
    LENGTH = 4


@dataclass(frozen=True, slots=True)
class StopRules:
    """The token-level stop conditions of one request, resolved once at add_request."""

    stop_ids: frozenset[int]  # stop_token_ids plus EOS ids unless ignore_eos
    min_new_tokens: int
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()  # the stop ids that are EOS only (not stop_token_ids)

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> StopRules:
        stop_token_ids = frozenset(params.stop_token_ids)
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids) - stop_token_ids
        return cls(stop_token_ids | eos, params.min_new_tokens, params.max_new_tokens, eos)


@dataclass(frozen=True, slots=True)
class Finish:
    pos: int  # output position f of the last retained token
    kind: FinishKind
    matched: int | str | None  # stop token id, stop string, or None (grammar, length)
    error: str | None = None  # GRAMMAR_ERROR: why the grammar could not accept the output

    @property
    def reason(self) -> str:
        if self.kind is FinishKind.GRAMMAR_ERROR:
            return "error"
        return "length" if self.kind is FinishKind.LENGTH else "stop"

    @property
    def kind_name(self) -> str:
        """"grammar_error", "eos", "stop_token", "stop_string", "grammar" or "length"."""
        return self.kind.name.lower()

    @property
    def finished_len(self) -> int:
        return self.pos + 1


def find_finish(
    window: Sequence[int],
    start: int,
    rules: StopRules,
    stop_string: StopStringHit | None = None,
    grammar_index: int | None = None,
    grammar_error: str | None = None,
) -> Finish | None:
    """The earliest finish in `window` (output positions `start..start+len(window)-1`), or None.

    `stop_string`: the earliest stop-string completion at a position >= min_new_tokens (None when
    none completes in the window). `grammar_index`: index in `window` where the grammar ended;
    `grammar_error`: why it ended without accepting the output there (None: it accepted it).
    """
    end = start + len(window)
    best: Finish | None = None
    first = max(0, rules.min_new_tokens - start)
    if rules.stop_ids:
        stop_ids = rules.stop_ids
        for i in range(first, len(window)):
            t = window[i]
            if t in stop_ids:
                kind = FinishKind.EOS if t in rules.eos_ids else FinishKind.STOP_TOKEN
                best = Finish(start + i, kind, int(t))
                break
    candidates = []
    if stop_string is not None:
        if not start <= stop_string.pos < end or stop_string.pos < rules.min_new_tokens:
            raise ValueError(f"stop-string hit at {stop_string.pos} outside [{start}, {end})")
        candidates.append(Finish(stop_string.pos, FinishKind.STOP_STRING, stop_string.stop))
    if grammar_index is not None:
        if grammar_error is not None:
            candidates.append(Finish(start + grammar_index, FinishKind.GRAMMAR_ERROR, None,
                                     grammar_error))
        else:
            candidates.append(Finish(start + grammar_index, FinishKind.GRAMMAR, None))
    if end >= rules.max_new_tokens:
        candidates.append(Finish(rules.max_new_tokens - 1, FinishKind.LENGTH, None))
    for c in candidates:
        if best is None or (c.pos, c.kind) < (best.pos, best.kind):
            best = c
    return best
