"""OpenAI response bodies and SSE chunks, built from per-choice state (pure)."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.output.request_output import Completion
from pipeline.output.tool_calls import ToolCall

TokenStr = Callable[[int], str]


@dataclass
class ChoiceState(Completion):
    index: int = 0
    parsed: bool = False  # tool calls parsed out of `text`: `content` and `tool_calls` hold it
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        reason = Completion.finish_reason.fget(self)  # type: ignore[attr-defined]
        return "tool_calls" if self.tool_calls and reason == "stop" else reason

    def message(self) -> dict[str, Any]:
        if not self.parsed:
            return {"role": "assistant", "content": self.text}
        out: dict[str, Any] = {"role": "assistant",
                               "content": self.content or (None if self.tool_calls else "")}
        if self.tool_calls:
            out["tool_calls"] = [c.openai() for c in self.tool_calls]
        return out


def stop_reason(c: Completion) -> Any:
    """vLLM's: the stop string or stop token id that ended the choice; None for EOS (one not in
    stop_token_ids), grammar, length or abort."""
    return c.matched_stop if c.finish_kind in ("stop_token", "stop_string") else None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
          ) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def cached_tokens(choices: list[ChoiceState], num_prompts: int) -> int | None:
    """Counted like `prompt_tokens`, each prompt once: the mean over its choices."""
    got = [c.cached_tokens for c in choices if c.cached_tokens is not None]
    if not got:
        return None
    return sum(got) * num_prompts // max(len(choices), 1)


def completion_logprobs(token_ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], token_str: TokenStr,
                        offset: int = 0) -> dict[str, Any]:
    """`offset`: the length of the text already sent."""
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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_response(rid: str, model: str, choices: list[ChoiceState], prompt_tokens: int,
                        logprobs_for: Callable[[ChoiceState], dict | None],
                        stop_reason_for: Callable[[ChoiceState], Any],
                        cached: int | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": c.index, "text": c.text, "logprobs": logprobs_for(c),
                     "finish_reason": c.finish_reason, "stop_reason": stop_reason_for(c),
                     "spec_stats": c.spec_stats()} for c in choices],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices), cached),
    }


def chat_response(rid: str, model: str, choices: list[ChoiceState], prompt_tokens: int,
                  logprobs_for: Callable[[ChoiceState], dict | None],
                  stop_reason_for: Callable[[ChoiceState], Any],
                  cached: int | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": c.index, "message": c.message(),
                     "logprobs": logprobs_for(c), "finish_reason": c.finish_reason,
                     "stop_reason": stop_reason_for(c), "spec_stats": c.spec_stats()}
                    for c in choices],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices), cached),
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
                completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached)}


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
