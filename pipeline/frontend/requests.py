"""OpenAI request bodies: parsing, validation and each choice's `SamplingParams`; every failure
is a 400 naming the parameter. Parsed with `json`, which keeps lone surrogates and NaN so the
parameter can be named rather than the body called invalid JSON."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.frontend.errors import bad_request, from_params_error, from_validation_error
from pipeline.frontend.tools import (
    MessageToolCall,
    Tool,
    ToolChoice,
    check_tools,
    template_tool_calls,
)
from pipeline.params import (
    MAX_LOGPROBS,
    MAX_NEW_TOKENS_LIMIT,
    MAX_SEED,
    MAX_TEMPERATURE,
    SamplingParams,
)

MAX_N = 16
MAX_PROMPTS = 64
MAX_JSON_DEPTH = 32


class _Strict(BaseModel):
    # "5" is not an int and true is not a number; extra keys are ignored, as vLLM does.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


def _documented(default: Any, **limits: Any) -> Any:
    """Limits published in the OpenAPI schema only (the checks are below and in SamplingParams):
    never stricter than those, or a schema-valid request would be refused."""
    return Field(default, json_schema_extra=limits)


_MAX_TOKENS = {"minimum": 1, "maximum": MAX_NEW_TOKENS_LIMIT}
_ONLY_ZERO = {"minimum": 0, "maximum": 0}


class StreamOptions(_Strict):
    include_usage: bool = False


class _CommonRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = _documented(None, **_MAX_TOKENS)
    temperature: float | None = _documented(None, minimum=0, maximum=MAX_TEMPERATURE)
    top_p: float | None = _documented(None, exclusiveMinimum=0, maximum=1)
    top_k: int | None = _documented(None, minimum=-1)
    seed: int | None = _documented(None, minimum=0, maximum=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = _documented(0, minimum=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # None: ServerSettings.split_special_tokens
    split_special_tokens: bool | None = None
    n: int = _documented(1, minimum=1, maximum=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted only at their no-op values: unimplemented, and never silently ignored.
    presence_penalty: float | None = _documented(None, **_ONLY_ZERO)
    frequency_penalty: float | None = _documented(None, **_ONLY_ZERO)
    repetition_penalty: float | None = _documented(None, minimum=1, maximum=1)
    logit_bias: dict[str, float] | None = _documented(None, maxProperties=0)
    best_of: int | None = _documented(None, minimum=1, maximum=MAX_N)
    # At most one of these (pipeline.frontend.structured).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


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
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = _documented(..., minItems=1)
    max_completion_tokens: int | None = _documented(None, **_MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = _documented(None, minimum=0, maximum=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


def parse_json_body(raw: bytes) -> dict[str, Any]:
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


# Unimplemented parameters: anything but null is a 400, since a client that asks for tool calls
# must not silently get free text. Other unknown keys do not change the output and are ignored.
_STRUCTURED = ("guided_grammar", "structured_outputs")
TOOLS = ("tools", "tool_choice")
TOOL_MESSAGE = ("tool_calls", "tool_call_id")
UNSUPPORTED_COMPLETION = (*_STRUCTURED, *TOOLS)
UNSUPPORTED_CHAT = (*_STRUCTURED, "functions", "function_call", "audio", "prediction",
                    "reasoning_effort", "web_search_options", "verbosity")
UNSUPPORTED_MESSAGE = ("function_call", "audio", "refusal")
_HINTS = {"functions": "; use tools", "function_call": "; use tool_choice",
          "tools": " (tool_call_parser is none)", "tool_choice": " (tool_call_parser is none)",
          "tool_calls": " (tool_call_parser is none)", "tool_call_id": " (tool_call_parser is none)"}


def reject_unsupported(data: dict[str, Any], names: tuple[str, ...],
                       hints: dict[str, str] | None = None) -> None:
    for name in names:
        if data.get(name) is not None:
            hint = (hints or {}).get(name, "")
            raise bad_request(f"{name}: is not supported by this server{hint}", param=name,
                              code="unsupported_parameter")
    modalities = data.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("modalities: only [\"text\"] is supported", param="modalities",
                          code="unsupported_parameter")


def _reject_unsupported_in_messages(messages: Any, tools: bool) -> None:
    if not isinstance(messages, list):
        return  # validation names it
    names = UNSUPPORTED_MESSAGE if tools else (*TOOL_MESSAGE, *UNSUPPORTED_MESSAGE)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        if not tools and m.get("role") == "tool":
            raise bad_request(f"messages[{i}].role: tool messages are not supported by this "
                              "server (tool_call_parser is none)", param=f"messages[{i}].role",
                              code="unsupported_parameter")
        for name in names:
            if m.get(name) is not None:
                param = f"messages[{i}].{name}"
                raise bad_request(f"{param}: is not supported by this server{_HINTS.get(name, '')}",
                                  param=param, code="unsupported_parameter")


def parse_completion_request(data: dict[str, Any]) -> CompletionRequest:
    reject_unsupported(data, UNSUPPORTED_COMPLETION)
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


def parse_chat_request(data: dict[str, Any], tools: bool = False) -> ChatCompletionRequest:
    """`tools`: tool calling is on (a `tool_call_parser`); off, its parameters are refused."""
    reject_unsupported(data, UNSUPPORTED_CHAT if tools else (*UNSUPPORTED_CHAT, *TOOLS), _HINTS)
    _reject_unsupported_in_messages(data.get("messages"), tools)
    req = _validate(ChatCompletionRequest, data)
    if not req.messages:
        raise bad_request("messages: must contain at least one message", param="messages")
    for i, m in enumerate(req.messages):
        for text in _message_texts(m):
            check_prompt_text(text, f"messages[{i}].content")
        if m.name is not None:
            check_prompt_text(m.name, f"messages[{i}].name")
        for j, call in enumerate(m.tool_calls or []):
            for key, text in (("id", call.id), ("function.name", call.function.name),
                              ("function.arguments", call.function.arguments)):
                check_prompt_text(text, f"messages[{i}].tool_calls[{j}].{key}")
        if m.tool_call_id is not None:
            check_prompt_text(m.tool_call_id, f"messages[{i}].tool_call_id")
    if req.tools:
        check_prompt_text(json.dumps([t.model_dump() for t in req.tools], ensure_ascii=False),
                          "tools")
    check_tools(req)
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
    """NUL and lone surrogates (not encodable) must not reach a tokenizer."""
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


def chat_messages_as_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    out = []
    for m in req.messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": "".join(_message_texts(m))}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = template_tool_calls(m.tool_calls)
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
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


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 keeps the user's seed; later choices get distinct ones."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % (MAX_SEED + 1)


def to_sampling_params(req: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                       max_model_len: int, choice_index: int = 0,
                       default_max_tokens: int = 16, grammar: Any = None) -> SamplingParams:
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
        "min_new_tokens": req.min_tokens, "seed": choice_seed(req.seed, choice_index),
        "grammar": grammar}
    if req.temperature is not None:
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
