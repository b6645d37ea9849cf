"""The delta a request's output advances by in one step, and the one fold of those deltas."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


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
    # "stop" | "length" | "abort" | None, or "error" (internal: the request failed, `error` says
    # why; the front end answers with an error body / stream event, never a choice)
    finish_reason: str | None = None
    # What ended it: "eos" | "stop_token" | "stop_string" | "grammar" | "grammar_error" |
    # "length" | "abort" | None (pipeline.output.finish.FinishKind; "eos" is an EOS id not also in
    # stop_token_ids)
    finish_kind: str | None = None
    matched_stop: int | str | None = None
    finished_len: int | None = None
    finish_step: int | None = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_histogram: list[int] = field(default_factory=list)
    spec_draft_tokens: int = 0
    error: str | None = None  # finish_reason "error": what went wrong (client-safe text)
    # prompt tokens whose KV came from the prefix cache: on the request's first delta only
    # (None on the others, and from stages that do not report it)
    cached_tokens: int | None = None


@dataclass
class Completion:
    """A request's deltas folded together: its whole output so far (the front end's choices, the
    CLI, benchmarks and tests all fold deltas with `add`)."""

    rid: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None  # None until a delta carries logprobs
    top_logprobs: list[list[tuple[int, float]]] | None = None
    last: RequestOutput | None = None  # the newest delta: finish and cumulative statistics
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache

    @classmethod
    def fold(cls, deltas: Iterable[RequestOutput]) -> Completion:
        done = cls()
        for delta in deltas:
            done.add(delta)
        return done

    def add(self, delta: RequestOutput) -> None:
        self.rid = delta.rid
        if delta.cached_tokens is not None and self.cached_tokens is None:
            self.cached_tokens = delta.cached_tokens
        self.token_ids += delta.token_ids
        self.text += delta.text
        # in place: the cost of a delta does not grow with the output
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs
        if delta.top_logprobs is not None:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs += delta.top_logprobs
        self.last = delta

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    @property
    def finish_reason(self) -> str | None:
        return self.last.finish_reason if self.last is not None else None

    @property
    def finish_kind(self) -> str | None:
        return self.last.finish_kind if self.last is not None else None

    @property
    def matched_stop(self) -> int | str | None:
        return self.last.matched_stop if self.last is not None else None

    def spec_stats(self) -> dict[str, Any]:
        """The HTTP `spec_stats` object (docs/contracts.md, *HTTP surface*: the four cumulative
        `spec_*` counts)."""
        last = self.last or RequestOutput(self.rid)
        return {"verify_ct": last.spec_verify_ct, "accepted_tokens": last.spec_accepted_tokens,
                "acceptance_histogram": list(last.spec_acceptance_histogram),
                "draft_tokens": last.spec_draft_tokens}
