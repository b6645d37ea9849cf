"""Tool calling's request side (docs/tool-calling.md): `tools`, `tool_choice`,
`parallel_tool_calls`, and messages carrying tool calls and tool results, checked (400 naming the
parameter) and shaped the way a chat template's `tools=` and `tool_calls` expect them."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.frontend.errors import bad_request
from pipeline.output.mistral_tool_calls import TOOL_CALLS
from pipeline.output.tool_calls import END, START

NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # OpenAI's function name rule


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class FunctionDef(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tools(req: Any) -> None:
    tools, choice = req.tools, req.tool_choice
    if choice is not None and not tools:
        raise bad_request("tool_choice: is only allowed when tools are specified",
                          param="tool_choice")
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request(f"tool_choice: no tool named {choice.function.name!r} in tools"[:200],
                          param="tool_choice.function.name")
    for i, m in enumerate(req.messages):
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"messages[{i}].tool_call_id: required in a tool message",
                              param=f"messages[{i}].tool_call_id")
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"messages[{i}].tool_calls: only assistant messages carry them",
                              param=f"messages[{i}].tool_calls")
        for j, call in enumerate(m.tool_calls or []):
            arguments_object(call.function.arguments,
                             f"messages[{i}].tool_calls[{j}].function.arguments")


def parses_tool_calls(req: Any) -> bool:
    return bool(getattr(req, "tools", None)) and req.tool_choice != "none"


def forces_tool_calls(req: Any) -> bool:
    """`required` or a named function: the grammar makes the output calls."""
    return bool(req_tools(req)) and getattr(req, "tool_choice", None) not in (None, "none", "auto")


def tool_names(req: Any) -> list[str]:
    return [t.function.name for t in req.tools or []]


def template_tools(req: Any) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def arguments_object(text: str, param: str) -> dict[str, Any]:
    try:
        args = json.loads(text)
    except (ValueError, RecursionError):
        args = None
    if not isinstance(args, dict):
        raise bad_request(f"{param}: must be a JSON object's text", param=param)
    return args


def template_tool_calls(calls: list[MessageToolCall]) -> list[dict[str, Any]]:
    """Arguments as objects: Hermes-style templates write them with `tojson`, as vLLM passes
    them."""
    return [{"id": c.id, "type": "function", "function": {
        "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in calls]


def template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def supports_tools(tokenizer: Any) -> bool:
    return "tools" in template_text(tokenizer)


def special_ids(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special tokens by their text."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {str(t.content): i for i, t in added.items() if getattr(t, "special", False)}


def tool_grammar(req: Any, parser: str = "hermes", special: dict[str, int] | None = None
                 ) -> str | None:
    """`required` or a named tool_choice as a Lark grammar: calls in the parser's format whose
    JSON follows the tools' schemas, so every call parses; None when the output is free. A
    marker that is a `special` token is that token, as the model writes it, not its text."""
    if not forces_tool_calls(req):
        return None
    choice = req.tool_choice
    tools = [t for t in req.tools if not isinstance(choice, NamedToolChoice)
             or t.function.name == choice.function.name]
    key = "parameters" if parser == "llama3_json" else "arguments"
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", key],
              "properties": {"name": {"const": t.function.name},
                             key: t.function.parameters or {"type": "object"}}}
             for t in tools]
    # Spaced as templates' `tojson` shows earlier calls: drafting finds them in the prompt.
    spacing = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    schema = {"x-guidance": spacing, "anyOf": calls}
    body = f"body: %json {json.dumps(schema)}\n"
    if parser == "llama3_json":
        more = ' ("; " body)*' if req.parallel_tool_calls is not False else ""
        return f"start: body{more}\n" + body  # no <|python_tag|>: a special token in Llama 3
    if parser == "mistral":
        more = ' (", " body)*' if req.parallel_tool_calls is not False else ""
        marker = f"<[{special[TOOL_CALLS]}]>" if TOOL_CALLS in (special or {}) else \
            f'"{TOOL_CALLS}"'
        return f'start: {marker} "[" body{more} "]"\n' + body
    more = ' ("\\n" call)*' if req.parallel_tool_calls is not False else ""
    return f'start: call{more}\ncall: "{START}\\n" body "\\n{END}"\n' + body


def req_tools(req: Any) -> list[Tool]:
    return getattr(req, "tools", None) or []
