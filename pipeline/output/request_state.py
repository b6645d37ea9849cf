"""What the output path keeps per request. Between steps `output_ids` is exactly the retained
output (`finished_len` long once finished) and every retained token's logprob went out once."""

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
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self is not RequestStatus.RUNNING


def count_into(histogram: list[int], index: int) -> None:
    """`histogram[index] += 1`, growing the list: shared with the engine's raw counts."""
    if index >= len(histogram):
        histogram.extend([0] * (index + 1 - len(histogram)))
    histogram[index] += 1


@dataclass(slots=True)
class SpecStats:
    """Over the retained output (docs/contracts.md, *Speculative statistics*): `kept - 1`
    accepted per verify step keeps `completion_tokens == 1 + verify_ct + accepted_tokens`."""

    verify_ct: int = 0
    accepted_tokens: int = 0
    draft_tokens: int = 0
    histogram: list[int] = field(default_factory=list)

    def add(self, kept: int, drafted: int) -> None:
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
    # int32 array: amortised growth, and invisible to the cyclic GC.
    output_ids: array = field(default_factory=lambda: array("i"))
    status: RequestStatus = RequestStatus.RUNNING
    finished_len: int | None = None
    matched_stop: int | str | None = None
    finish_kind: str | None = None
    error: str | None = None
    finish_step: int | None = None
    last_step: int = -1  # a step not above it is replayed or stale: dropped
    logprobs_sent: int = 0
    text: TextState | None = None
    stops: StopStrings | None = None
    grammar: Any = None  # a pipeline.grammar.GrammarMatcher
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def remaining(self) -> int:
        return self.rules.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is not RequestStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        return None if self.status is RequestStatus.RUNNING else self.status.value
