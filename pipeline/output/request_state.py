"""What the output path keeps per request: plain counters, offsets and a status enum.

Invariants (between steps):
- `output_ids` holds exactly the retained output; once finished, `len(output_ids) == finished_len`.
- `logprobs_sent == len(output_ids)`: every retained token's logprob went out in exactly one delta.
- Text: everything emitted + `text.pending` == the committed text (see pipeline.output.detokenizer).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pipeline.output.finish import StopRules
from pipeline.params import SamplingParams


class RequestStatus(Enum):
    RUNNING = "running"
    FINISHED_STOP = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self is not RequestStatus.RUNNING


@dataclass(slots=True)
class TextState:
    """Incremental detokenization of one request (vLLM-style offsets into `output_ids`).

    Text of the window `output_ids[prefix_offset:]` is decoded each step; `prefix_offset..
    read_offset` is context already turned into text (`decode(ids[prefix:read])`, empty for
    byte-level tokenizers, which need no context). `extra` counts committed characters of the
    window beyond that context text; trailing U+FFFD (a character whose bytes have not all
    arrived) is never committed until a later token or the finish settles it.
    """

    prefix_offset: int = 0
    read_offset: int = 0
    extra: int = 0
    tail: str = ""  # last (max stop length - 1) committed chars: context for the stop search
    pending: str = ""  # committed text held back: it could be the start of a stop string
    chars_sent: int = 0


@dataclass(slots=True)
class SpecStats:
    """Speculative statistics over the retained output (DESIGN.md)."""

    verify_ct: int = 0
    accepted_tokens: int = 0
    histogram: list[int] = field(default_factory=list)

    def add(self, accepted: int) -> None:
        hist = self.histogram
        if accepted >= len(hist):
            hist.extend([0] * (accepted + 1 - len(hist)))
        hist[accepted] += 1
        self.verify_ct += 1
        self.accepted_tokens += accepted


@dataclass(slots=True)
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
    finish_step: int | None = None
    last_step: int = -1  # newest step applied: a replayed or stale step is dropped, not re-applied
    logprobs_sent: int = 0
    text: TextState | None = None  # None when the processor has no tokenizer
    stops: Any = None  # a pipeline.output.detokenizer.StopStrings, or None without stop strings
    grammar: Any = None  # a pipeline.grammar.GrammarMatcher, or None
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

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
