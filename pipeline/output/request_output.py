"""The delta a request's output advances by in one step."""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class RequestOutput:
    """New retained output of one request since its previous delta.

    `logprobs` / `top_logprobs` align one-to-one with `token_ids` (None when the request asked for no
    logprobs). The `spec_*` statistics are cumulative over the request's retained output.
    """

    rid: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    matched_stop: int | str | None = None
    finished_len: int | None = None
    finish_step: int | None = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_histogram: list[int] = field(default_factory=list)
