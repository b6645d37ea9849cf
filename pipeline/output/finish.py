"""The finish rules (docs/contracts.md, *Finish rules (normative)*) as one pure function over a
step's window. Stop strings depend on text, not on the window alone: the caller finds the hit
(`pipeline.output.text.find_stop`) and passes it in."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

from pipeline.output.text import StopStringHit
from pipeline.params import SamplingParams


class FinishKind(IntEnum):
    """The value is the tie order at one position (EOS and STOP_TOKEN never tie)."""

    GRAMMAR_ERROR = -1
    EOS = 0
    STOP_TOKEN = 1
    STOP_STRING = 2
    GRAMMAR = 3
    LENGTH = 4


@dataclass(frozen=True, slots=True)
class StopRules:
    stop_ids: frozenset[int]  # stop_token_ids plus EOS ids unless ignore_eos
    min_new_tokens: int
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()  # the stop ids not in stop_token_ids

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> StopRules:
        stop_token_ids = frozenset(params.stop_token_ids)
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids) - stop_token_ids
        return cls(stop_token_ids | eos, params.min_new_tokens, params.max_new_tokens, eos)


@dataclass(frozen=True, slots=True)
class Finish:
    pos: int  # of the last retained token
    kind: FinishKind
    matched: int | str | None
    error: str | None = None

    @property
    def reason(self) -> str:
        if self.kind is FinishKind.GRAMMAR_ERROR:
            return "error"
        return "length" if self.kind is FinishKind.LENGTH else "stop"

    @property
    def kind_name(self) -> str:
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
    """The earliest finish in `window` (output positions from `start`), or None. `grammar_error`:
    why the grammar ended at `grammar_index` without accepting the output there."""
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
