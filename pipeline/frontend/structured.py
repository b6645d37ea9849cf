"""Structured output parameters (`response_format`, vLLM's `guided_*`; at most one) -> a grammar
compiled against the served tokenizer before the request takes a queue place or a slot."""

from __future__ import annotations

from typing import Any

from pipeline.frontend.errors import bad_request
from pipeline.frontend.tools import special_ids, tool_grammar
from pipeline.grammar.llg import compile_grammar

GUIDED = ("guided_json", "guided_regex", "guided_choice")


def wants_grammar(req: Any, tool_parser: str = "hermes") -> bool:
    fmt = req.response_format
    return any(getattr(req, name) is not None for name in GUIDED) or (
        fmt is not None and fmt.get("type") != "text") or tool_grammar(req, tool_parser) is not None


def grammar_source(req: Any, tool_parser: str = "hermes", tokenizer: Any = None
                   ) -> tuple[str, Any, str] | None:
    """(grammar kind, source, parameter), or None for free text."""
    found: list[tuple[str, Any, str]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append(spec)
    if req.guided_json is not None:
        found.append(("json_schema", req.guided_json, "guided_json"))
    if req.guided_regex is not None:
        found.append(("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        found.append(("choice", req.guided_choice, "guided_choice"))
    tools = tool_grammar(req, tool_parser, special_ids(tokenizer))
    if tools is not None:
        found.append(("lark", tools, "tool_choice"))
    if len(found) > 1:
        names = ", ".join(param.split(".")[0] for _, _, param in found)
        raise bad_request(f"{names}: set at most one structured output parameter",
                          param=found[1][2])
    return found[0] if found else None


def _response_format(fmt: dict[str, Any]) -> tuple[str, Any, str] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", {"type": "object"}, "response_format"
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema: must be an object with a schema",
                              param="response_format.json_schema")
        schema = spec.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format.json_schema.schema: must be a JSON schema object",
                              param="response_format.json_schema.schema")
        return "json_schema", schema, "response_format.json_schema.schema"
    raise bad_request(f"response_format.type: must be 'text', 'json_object' or 'json_schema', "
                      f"got {kind!r}"[:200], param="response_format.type")


def request_grammar(req: Any, tokenizer: Any, tool_parser: str = "hermes") -> Any:
    source = grammar_source(req, tool_parser, tokenizer)
    if source is None:
        return None
    kind, text, param = source
    try:
        return compile_grammar(kind, text, tokenizer)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param=param, code="invalid_grammar") from None
