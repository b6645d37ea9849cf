"""Llama 3.x JSON tool calls (vLLM's `llama3_json`): an output that starts with
`<|python_tag|>` or `{` and is `{"name": ..., "parameters": {...}}` objects separated by `;`.
Whether such an output is calls is known only when it ends, so it is held whole; any other
output is content from its first character that cannot start one."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection

from pipeline.output.tool_calls import ToolCall, ToolDelta, ToolStream, call_of, no_constant

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder(parse_constant=no_constant)


class Llama3JsonStream(ToolStream):
    def __init__(self, names: Collection[str] | None = None,
                 new_id: Callable[[int], str] = lambda i: f"call_{i}") -> None:
        super().__init__(names, new_id)
        self._parts: list[str] = []
        self._mode = "start"  # then "content" or "calls"

    def feed(self, text: str) -> ToolDelta:
        if self._mode == "content":
            self.content += text
            return ToolDelta(text)
        self._parts.append(text)
        if self._mode == "calls":
            return ToolDelta()
        held = "".join(self._parts)
        head = held.lstrip()
        if head.startswith(("{", PYTHON_TAG)):
            self._mode = "calls"
        elif head and not PYTHON_TAG.startswith(head):
            self._mode, self._parts = "content", []
            self.content += held
            return ToolDelta(held)
        else:
            self._parts = [held]
        return ToolDelta()

    def finish(self) -> ToolDelta:
        text = "".join(self._parts)
        self._parts = []
        calls = self._parse(text) if self._mode == "calls" else None
        if calls is None:
            self.content += text
            return ToolDelta(text)
        self.calls += calls
        return ToolDelta("", calls)

    def _parse(self, text: str) -> list[ToolCall] | None:
        body = text.lstrip().removeprefix(PYTHON_TAG).lstrip()
        calls: list[ToolCall] = []
        while True:
            try:
                obj, end = _DECODER.raw_decode(body)
            except (ValueError, RecursionError):
                return None
            call = (call_of(obj, "parameters", self.names, len(calls), self.new_id)
                    or call_of(obj, "arguments", self.names, len(calls), self.new_id))
            if call is None:
                return None
            calls.append(call)
            body = body[end:].lstrip()
            if not body:
                return calls
            if not body.startswith(";"):
                return None
            body = body[1:].lstrip()
