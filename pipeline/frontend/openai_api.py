"""OpenAI-compatible request validation, responses and SSE chunks (pure: no Ray, no app state).

Requests are parsed with Python's `json` (it keeps lone surrogates and NaN so we can name the
offending parameter instead of failing as "invalid JSON"), validated by strict pydantic models,
then turned into `SamplingParams`. Every failure is an `APIError` that renders as an OpenAI error
body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.output.request_output import RequestOutput
from pipeline.params import MAX_LOGPROBS, MAX_NEW_TOKENS_LIMIT, MAX_SEED, SamplingParams

MAX_N = 16
MAX_PROMPTS = 64  # prompts per batched completions request
MAX_JSON_DEPTH = 32
TokenStr = Callable[[int], str]  # token id -> its text, for logprob tables


# ----------------------------------------------------------------------------- errors


@dataclass
class APIError(Exception):
    """An error with its HTTP status and OpenAI error body fields."""

    status_code: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "function-after"}


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    # ("messages", 0, "role") -> "messages[0].role"; union tags such as "list[int]" are dropped
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part not in _UNION_TAGS and not re.search(r"[\[\]-]", part):
            out += ("." if out else "") + part
    return out or None


def from_validation_error(err: ValidationError) -> APIError:
    first = err.errors(include_url=False)[0]
    param = _loc_to_param(tuple(first.get("loc", ())))
    return bad_request(f"{param}: {first['msg']}" if param else first["msg"], param=param)


# Our SamplingParams field names -> the OpenAI parameter the user actually sent.
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def from_params_error(err: ValueError, renames: dict[str, str] | None = None) -> APIError:
    msg = str(err)
    field_name = msg.split(":", 1)[0].strip() if ":" in msg else None
    names = {**_PARAM_NAMES, **(renames or {})}
    param = names.get(field_name, field_name) if field_name else None
    if param and field_name and field_name != param:
        msg = param + msg[len(field_name):]
    return bad_request(msg, param=param)


# ----------------------------------------------------------------------------- requests


class _Strict(BaseModel):
    # strict: "5" is not an int and true is not a number; extra keys are ignored like vLLM does.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


def _documented(default: Any, **limits: Any) -> Any:
    """A field whose limits are published in the OpenAPI schema only. The checks themselves stay
    in `parse_*_request` / SamplingParams (400s naming the parameter); a limit here must never be
    stricter than they are, or a schema-valid request would be refused."""
    return Field(default, json_schema_extra=limits)


_MAX_TOKENS = {"minimum": 1, "maximum": MAX_NEW_TOKENS_LIMIT}
_ONLY_ZERO = {"minimum": 0, "maximum": 0}


class StreamOptions(_Strict):
    include_usage: bool = False


class _CommonRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = _documented(None, **_MAX_TOKENS)
    temperature: float | None = _documented(None, minimum=0)
    top_p: float | None = _documented(None, exclusiveMinimum=0, maximum=1)
    top_k: int | None = _documented(None, minimum=-1)
    seed: int | None = _documented(None, minimum=0, maximum=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = _documented(0, minimum=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = _documented(1, minimum=1, maximum=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None  # only with stream: true
    user: str | None = None
    # Accepted only at their no-op values (we do not implement them; never silently ignore).
    presence_penalty: float | None = _documented(None, **_ONLY_ZERO)
    frequency_penalty: float | None = _documented(None, **_ONLY_ZERO)
    repetition_penalty: float | None = _documented(None, minimum=1, maximum=1)
    logit_bias: dict[str, float] | None = _documented(None, maxProperties=0)
    best_of: int | None = _documented(None, minimum=1, maximum=MAX_N)  # 1 or n


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = _documented(
        ..., minLength=1, minItems=1)
    logprobs: int | None = _documented(None, minimum=0, maximum=MAX_LOGPROBS)
    echo: bool = _documented(False, const=False)
    suffix: str | None = _documented(None, maxLength=0)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = _documented(..., minItems=1)
    max_completion_tokens: int | None = _documented(None, **_MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = _documented(None, minimum=0, maximum=MAX_LOGPROBS)  # needs logprobs
    add_generation_prompt: bool = True


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 naming what is wrong."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    if _depth(data) > MAX_JSON_DEPTH:
        raise bad_request("request body is nested too deeply")
    return data


def _depth(obj: Any, level: int = 0) -> int:
    if level > MAX_JSON_DEPTH:
        return level
    if isinstance(obj, dict):
        return max((_depth(v, level + 1) for v in obj.values()), default=level + 1)
    if isinstance(obj, list):
        return max((_depth(v, level + 1) for v in obj), default=level + 1)
    return level


def parse_completion_request(data: dict[str, Any]) -> CompletionRequest:
    req = _validate(CompletionRequest, data)
    if req.echo:
        raise bad_request("echo is not supported", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {req.logprobs}",
                          param="logprobs")
    _check_common(req)
    return req


def parse_chat_request(data: dict[str, Any]) -> ChatCompletionRequest:
    req = _validate(ChatCompletionRequest, data)
    if not req.messages:
        raise bad_request("messages: must contain at least one message", param="messages")
    for i, m in enumerate(req.messages):
        for text in _message_texts(m):
            check_prompt_text(text, f"messages[{i}].content")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                param="top_logprobs")
        if not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", param="top_logprobs")
    if req.max_completion_tokens is not None:
        req.max_tokens = req.max_completion_tokens
    _check_common(req)
    return req


def _validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _check_common(req: _CommonRequest) -> None:
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n: must be in [1, {MAX_N}], got {req.n}", param="n")
    if req.best_of not in (None, 1, req.n):
        raise bad_request("best_of: only best_of == n is supported", param="best_of")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options: only allowed when stream is true",
                          param="stream_options")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0.0):
            raise bad_request(f"{name}: is not supported (only 0)", param=name)
    if req.repetition_penalty not in (None, 1.0):
        raise bad_request("repetition_penalty: is not supported (only 1)",
                          param="repetition_penalty")
    for s in [req.stop] if isinstance(req.stop, str) else req.stop or []:
        check_prompt_text(s, "stop")
    if req.logit_bias:
        raise bad_request("logit_bias: is not supported", param="logit_bias")
    if req.max_tokens is not None and req.max_tokens < 1:
        chat_max = getattr(req, "max_completion_tokens", None)
        name = "max_completion_tokens" if chat_max is not None else "max_tokens"
        raise bad_request(f"{name}: must be at least 1, got {req.max_tokens}", param=name)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_prompt_text(text: str, param: str) -> None:
    """Reject text no tokenizer should see: NUL and lone UTF-16 surrogates (not encodable)."""
    if "\x00" in text:
        raise bad_request(f"{param}: must not contain NUL characters", param=param)
    if _LONE_SURROGATE.search(text):
        raise bad_request(f"{param}: contains a lone surrogate (invalid Unicode)", param=param)


def _message_texts(m: ChatMessage) -> list[str]:
    if m.content is None:
        return []
    if isinstance(m.content, str):
        return [m.content]
    return [p.text for p in m.content]


def chat_messages_as_dicts(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the plain dicts chat templates expect (`developer` is a system message)."""
    return [{"role": "system" if m.role == "developer" else m.role,
             "content": "".join(_message_texts(m))} for m in req.messages]


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one string or id list each; empty and malformed ones rejected."""
    p = req.prompt
    prompts: list[str | list[int]]
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        prompts = [p]  # type: ignore[list-item]
    else:
        prompts = list(p)  # type: ignore[arg-type]
    if not prompts:
        raise bad_request("prompt: must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts per request", param="prompt")
    for i, one in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if len(one) == 0:
            raise bad_request(f"{name}: must not be empty", param="prompt")
        if isinstance(one, str):
            check_prompt_text(one, "prompt")
    return prompts


def check_prompt_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise bad_request(f"{param}: token id {t} is outside the vocabulary [0, {vocab_size})",
                              param=param)


def openapi_schema() -> dict[str, Any]:
    """The served OpenAPI 3.1 document: request bodies from the pydantic models above, OpenAI
    error bodies for every error status (what /openapi.json returns and schema fuzzers use)."""
    components: dict[str, Any] = {}

    def body_ref(model: type[BaseModel]) -> dict[str, Any]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        return {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}

    error = {"description": "an OpenAI error body", "content": {"application/json": {
        "schema": {"type": "object", "required": ["error"]}}}}
    errors = {str(code): error for code in (400, 401, 404, 408, 413, 429, 431, 503)}
    ok_json = {"description": "OK", "content": {"application/json": {"schema": {}}}}
    ok_any = {"description": "OK (JSON, or an SSE stream when stream is true)"}

    def post(model: type[BaseModel]) -> dict[str, Any]:
        return {"post": {"requestBody": body_ref(model), "responses": {"200": ok_any, **errors}}}

    def get(ok: dict[str, Any]) -> dict[str, Any]:
        return {"get": {"responses": {"200": ok, **errors}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "specrelay", "version": "1"},
        "paths": {
            "/v1/completions": post(CompletionRequest),
            "/v1/chat/completions": post(ChatCompletionRequest),
            "/v1/models": get(ok_json),
            "/health": get(ok_json),
            "/metrics": get({"description": "Prometheus text"}),
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


# ----------------------------------------------------------------------------- sampling params


def derive_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: choice 0 keeps the user's seed, later ones get distinct seeds."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % (MAX_SEED + 1)


def to_sampling_params(req: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                       max_model_len: int, choice_index: int = 0,
                       default_max_tokens: int = 16) -> SamplingParams:
    """SamplingParams for one choice; checks the context window; errors name the user's param."""
    is_chat = isinstance(req, ChatCompletionRequest)
    max_name = ("max_completion_tokens" if is_chat and req.max_completion_tokens is not None
                else "max_tokens")
    room = max_model_len - prompt_len
    if room <= 0:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens, leaving no room for a completion.",
            param="messages" if is_chat else "prompt", code="context_length_exceeded")
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = room if is_chat else min(default_max_tokens, room)
    if max_tokens > room:
        raise bad_request(
            f"{max_name}: this model's maximum context length is {max_model_len} tokens; you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion).", param=max_name, code="context_length_exceeded")
    if is_chat:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_tokens, "stop": req.stop or [],
        "stop_token_ids": req.stop_token_ids or [], "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens, "logprobs": logprobs,
        "min_new_tokens": req.min_tokens, "seed": derive_seed(req.seed, choice_index)}
    if req.temperature is not None:
        if req.temperature > 2.0:
            raise bad_request(f"temperature: must be in [0, 2], got {req.temperature}",
                              param="temperature")
        kwargs["temperature"] = req.temperature
    if req.top_p is not None:
        kwargs["top_p"] = req.top_p
    if req.top_k is not None:
        kwargs["top_k"] = req.top_k
    renames = {"max_new_tokens": max_name}
    if is_chat:
        renames["logprobs"] = "top_logprobs"
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_params_error(e, renames) from None


# ----------------------------------------------------------------------------- choice state


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
        if out.finished:
            self.finish_reason = out.finish_reason
            self.matched_stop = out.matched_stop

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def spec_stats(self) -> dict[str, Any]:
        return {"verify_ct": self.spec_verify_ct, "accepted_tokens": self.spec_accepted_tokens,
                "acceptance_histogram": self.spec_acceptance_histogram}


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
