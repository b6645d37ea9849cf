"""The delta a request's output advances by in one step, and the one fold of those deltas."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    """New retained output of one request since its previous delta; the `spec_*` statistics are
    cumulative. Fields: docs/contracts.md, *RequestOutput*."""

    rid: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    finish_kind: str | None = None
    matched_stop: int | str | None = None
    finished_len: int | None = None
    finish_step: int | None = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_histogram: list[int] = field(default_factory=list)
    spec_draft_tokens: int = 0
    error: str | None = None
    cached_tokens: int | None = None  # on the first delta only


@dataclass
class Completion:
    """A request's deltas folded together (the one fold: front end, CLI and tests use it)."""

    rid: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    last: RequestOutput | None = None
    cached_tokens: int | None = None

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
        """The HTTP `spec_stats` object (docs/contracts.md, *HTTP surface*)."""
        last = self.last or RequestOutput(self.rid)
        return {"verify_ct": last.spec_verify_ct, "accepted_tokens": last.spec_accepted_tokens,
                "acceptance_histogram": list(last.spec_acceptance_histogram),
                "draft_tokens": last.spec_draft_tokens}
