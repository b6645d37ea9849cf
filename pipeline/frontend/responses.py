"""OpenAI response bodies and SSE stream chunks, and the per-choice state they are built from
(pure: no app state)."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.output.request_output import RequestOutput

TokenStr = Callable[[int], str]  # token id -> its text, for logprob tables


@dataclass
class ChoiceState:
    """One choice's output so far, accumulated from RequestOutput deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_histogram: list[int] = field(default_factory=list)
    spec_draft_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        if out.logprobs is not None:
            self.logprobs += out.logprobs
        if out.top_logprobs is not None:
            self.top_logprobs += out.top_logprobs
        self.spec_verify_ct = out.spec_verify_ct
        self.spec_accepted_tokens = out.spec_accepted_tokens
        self.spec_acceptance_histogram = list(out.spec_acceptance_histogram)
        self.spec_draft_tokens = out.spec_draft_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.matched_stop = out.matched_stop

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def spec_stats(self) -> dict[str, Any]:
        return {"verify_ct": self.spec_verify_ct, "accepted_tokens": self.spec_accepted_tokens,
                "acceptance_histogram": self.spec_acceptance_histogram,
                "draft_tokens": self.spec_draft_tokens}


def stop_reason(matched: int | str | None, finish_reason: str | None,
                eos_token_ids: frozenset[int] | set[int], stop_token_ids: list[int]) -> Any:
    """vLLM's `stop_reason`: the stop string or stop token id; None for EOS or length."""
    if finish_reason != "stop" or matched is None:
        return None
    if isinstance(matched, int) and matched in eos_token_ids and matched not in stop_token_ids:
        return None
    return matched


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ----------------------------------------------------------------------------- logprobs


def completion_logprobs(token_ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], token_str: TokenStr,
                        offset: int = 0) -> dict[str, Any]:
    """The legacy completions `logprobs` object for these tokens; `offset` = text already sent."""
    tokens = [token_str(t) for t in token_ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    tops: list[dict[str, float] | None] = []
    for i in range(len(token_ids)):
        row = top[i] if i < len(top) else []
        tops.append({token_str(t): _finite(lp) for t, lp in row} or None)
    return {"tokens": tokens, "token_logprobs": [_finite(x) for x in logprobs],
            "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]], token_str: TokenStr) -> dict[str, Any]:
    """The chat `logprobs` object: `content` holds one entry per token."""
    content = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        row = top[i] if i < len(top) else []
        s = token_str(t)
        content.append({"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": token_str(a), "logprob": _finite(b),
                                          "bytes": list(token_str(a).encode("utf-8"))}
                                         for a, b in row]})
    return {"content": content}


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number (vLLM uses -9999.0 the same way).
    return x if math.isfinite(x) else -9999.0


# ----------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_response(rid: str, model: str, choices: list[ChoiceState], prompt_tokens: int,
                        logprobs_for: Callable[[ChoiceState], dict | None],
                        stop_reason_for: Callable[[ChoiceState], Any]) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": c.index, "text": c.text, "logprobs": logprobs_for(c),
                     "finish_reason": c.finish_reason, "stop_reason": stop_reason_for(c),
                     "spec_stats": c.spec_stats()} for c in choices],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }


def chat_response(rid: str, model: str, choices: list[ChoiceState], prompt_tokens: int,
                  logprobs_for: Callable[[ChoiceState], dict | None],
                  stop_reason_for: Callable[[ChoiceState], Any]) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": logprobs_for(c), "finish_reason": c.finish_reason,
                     "stop_reason": stop_reason_for(c), "spec_stats": c.spec_stats()}
                    for c in choices],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }


def completion_chunk(rid: str, model: str, created: int, index: int, text: str,
                     logprobs: dict | None = None, finish_reason: str | None = None,
                     stop_reason: Any = None, spec_stats: dict | None = None) -> dict[str, Any]:
    return _chunk("text_completion", rid, model, created,
                  {"index": index, "text": text}, logprobs, finish_reason, stop_reason, spec_stats)


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict[str, Any],
               logprobs: dict | None = None, finish_reason: str | None = None,
               stop_reason: Any = None, spec_stats: dict | None = None) -> dict[str, Any]:
    return _chunk("chat.completion.chunk", rid, model, created,
                  {"index": index, "delta": delta}, logprobs, finish_reason, stop_reason,
                  spec_stats)


def _chunk(obj: str, rid: str, model: str, created: int, choice: dict[str, Any],
           logprobs: dict | None, finish_reason: str | None, stop_reason: Any,
           spec_stats: dict | None) -> dict[str, Any]:
    choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
    if spec_stats is not None:
        choice["spec_stats"] = spec_stats
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
