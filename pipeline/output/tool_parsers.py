"""The tool-call parsers by their config names (vLLM's), and the marker texts each needs kept in
the decoded text."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any

from pipeline.output.forced_tool_calls import ForcedCallStream
from pipeline.output.llama3_tool_calls import PYTHON_TAG, Llama3JsonStream
from pipeline.output.mistral_tool_calls import TOOL_CALLS, MistralStream
from pipeline.output.tool_calls import END, START, HermesStream

PARSERS = ("none", "hermes", "llama3_json", "mistral")
MARKERS = {"hermes": (START, END), "llama3_json": (PYTHON_TAG,), "mistral": (TOOL_CALLS,)}
# What a chat template of the parser's family writes for an assistant's call.
TEMPLATE_SIGNS = {"hermes": START, "llama3_json": '"parameters"', "mistral": TOOL_CALLS}


def new_tool_stream(parser: str, names: Collection[str], forced: bool = False) -> Any:
    """A per-choice parser: `feed` text deltas, then `finish`. `forced`: the grammar makes every
    call parse, whatever the parser's markup (pipeline.output.forced_tool_calls)."""
    kind = ForcedCallStream if forced else {
        "hermes": HermesStream, "llama3_json": Llama3JsonStream, "mistral": MistralStream}[parser]
    return kind(names, _call_id)


def check_parser_template(parser: str, template: str) -> None:
    """A template that shows tools but writes calls in another format than `parser` reads:
    every call would silently end as content, so refuse to start."""
    sign = TEMPLATE_SIGNS.get(parser)
    if sign is not None and "tools" in template and sign not in template:
        raise ValueError(f"tool_call_parser: {parser!r} reads calls written with {sign}, which "
                         f"this model's chat template never writes; choose the parser of its "
                         f"family ({', '.join(PARSERS[1:])})")


def _call_id(index: int) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
