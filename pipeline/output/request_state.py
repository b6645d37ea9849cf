"""What the output path keeps per request: plain counters, offsets and a status enum.

Invariants (between steps):
- `output_ids` holds exactly the retained output; once finished, `len(output_ids) == finished_len`.
- `logprobs_sent == len(output_ids)`: every retained token's logprob went out in exactly one delta.
- Text: everything emitted + `text.pending` == the committed text (pipeline.output.text).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pipeline.output.finish import StopRules
from pipeline.output.text import StopStrings, TextState
from pipeline.params import SamplingParams


class RequestStatus(Enum):
    RUNNING = "running"
    FINISHED_STOP = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # internal: the front end answers with an error, never a choice

    @property
    def finished(self) -> bool:
        return self is not RequestStatus.RUNNING


def count_into(histogram: list[int], index: int) -> None:
    """`histogram[index] += 1`, growing the list as needed: the one acceptance-histogram rule
    (request statistics here, the engine's raw counts in pipeline.engine.core)."""
    if index >= len(histogram):
        histogram.extend([0] * (index + 1 - len(histogram)))
    histogram[index] += 1


@dataclass(slots=True)
class SpecStats:
    """Speculative statistics over the retained output (docs/contracts.md, *Speculative
    statistics*).

    Every step after the prefill that retained tokens is a verify step, drafted or not. A step
    retaining `kept` tokens counts `kept - 1` accepted: the whole window less the target's token,
    or, when a finish cut the window, the retained tokens less the one the forward paid for.
    That keeps `completion_tokens == 1 + verify_ct + accepted_tokens` exact for every request.
    """

    verify_ct: int = 0
    accepted_tokens: int = 0
    draft_tokens: int = 0
    histogram: list[int] = field(default_factory=list)

    def add(self, kept: int, drafted: int) -> None:
        """One verify step that retained `kept >= 1` tokens of a window with `drafted` drafts."""
        count_into(self.histogram, kept - 1)
        self.verify_ct += 1
        self.accepted_tokens += kept - 1
        self.draft_tokens += drafted


@dataclass(slots=True, eq=False)  # one per running request: equal means the same request
class RequestState:
    rid: str
    params: SamplingParams
    rules: StopRules
    num_prompt_tokens: int
    # Retained output ids: a compact int32 array (amortised growth, invisible to the cyclic GC,
    # so a long output costs nothing per step).
    output_ids: array = field(default_factory=lambda: array("i"))
    status: RequestStatus = RequestStatus.RUNNING
    finished_len: int | None = None
    matched_stop: int | str | None = None
    finish_kind: str | None = None  # RequestOutput.finish_kind
    error: str | None = None  # FINISHED_ERROR: what went wrong (RequestOutput.error)
    finish_step: int | None = None
    last_step: int = -1  # newest step applied: a replayed or stale step is dropped, not re-applied
    logprobs_sent: int = 0
    text: TextState | None = None  # None when the processor has no tokenizer
    stops: StopStrings | None = None  # None without stop strings
    grammar: Any = None  # a pipeline.grammar.GrammarMatcher, or None
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def remaining(self) -> int:
        """Tokens the request may still take before the length limit."""
        return self.rules.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is not RequestStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        return None if self.status is RequestStatus.RUNNING else self.status.value
