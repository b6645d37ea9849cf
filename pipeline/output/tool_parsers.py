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


def new_tool_stream(parser: str, names: Collection[str], forced: bool = False) -> Any:
    """A per-choice parser: `feed` text deltas, then `finish`. `forced`: the grammar makes every
    call parse, whatever the parser's markup (pipeline.output.forced_tool_calls)."""
    kind = ForcedCallStream if forced else {
        "hermes": HermesStream, "llama3_json": Llama3JsonStream, "mistral": MistralStream}[parser]
    return kind(names, _call_id)


def _call_id(index: int) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
