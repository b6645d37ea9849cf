"""Mistral tool calls (vLLM's `mistral`, the pre-v11 format): `[TOOL_CALLS]` then a JSON array of
`{"name": ..., "arguments": {...}}`. Text before the marker is content, held only while its end
could be the start of one; the array is held until its brackets close, then sent whole if every
element is a call, else it is content with the marker, as HermesStream does with a bad call."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection

from pipeline.output.tool_calls import (
    ToolCall,
    ToolDelta,
    ToolStream,
    call_of,
    no_constant,
    partial_marker,
)

TOOL_CALLS = "[TOOL_CALLS]"
_WS = " \t\r\n"  # JSON's whitespace
_OUTSIDE = re.compile(r'["\[\]{}]')
_INSIDE = re.compile(r'["\\]')


class MistralStream(ToolStream):
    """`feed` each text delta, then `finish`; the deltas' concatenation is the same however the
    text was cut. Whitespace after an array of calls is dropped; other text there is content."""

    def __init__(self, names: Collection[str] | None = None,
                 new_id: Callable[[int], str] = lambda i: f"call_{i}") -> None:
        super().__init__(names, new_id)
        self._buf = ""  # content that may end in a partial marker
        self._in_call = False
        # The text after a marker arrives in `_parts`, joined once the array closes: each
        # character is scanned once (`_depth`, `_in_str`, `_escape`), so long arguments stay
        # linear. `_depth` 0 in a call: the `[` has not come yet.
        self._parts: list[str] = []
        self._depth = 0
        self._in_str = self._escape = False

    def feed(self, text: str) -> ToolDelta:
        return self._run(text, final=False)

    def finish(self) -> ToolDelta:
        return self._run("", final=True)

    def _run(self, text: str, final: bool) -> ToolDelta:
        out = ToolDelta()
        while True:
            if not self._in_call:
                text, self._buf = self._buf + text, ""
                i = text.find(TOOL_CALLS)
                if i < 0:
                    cut = len(text) - (0 if final else partial_marker(text, TOOL_CALLS))
                    self._outside(out, text[:cut], closing=final)
                    self._buf = text[cut:]
                    break
                self._outside(out, text[:i], closing=True)
                self._in_call, text = True, text[i + len(TOOL_CALLS):]
                continue
            start = 0
            if self._depth == 0:
                start = len(text) - len(text.lstrip(_WS))
                if start < len(text) and text[start] != "[":  # not an array: content
                    self._leave(out, None, "".join(self._parts) + text[:start])
                    text = text[start:]
                    continue
            end = self._close(text, start) if start < len(text) else -1
            if end < 0:
                self._parts.append(text)
                if final:  # never closed: the raw text is content
                    self._leave(out, None, "".join(self._parts))
                break
            body, text = "".join(self._parts) + text[:end], text[end:]
            self._leave(out, self._parse(body), body)
        self.content += out.content
        return out

    def _leave(self, out: ToolDelta, calls: list[ToolCall] | None, body: str) -> None:
        if calls is None:
            out.content += TOOL_CALLS + body
        else:
            out.calls += calls
            self.calls += calls
        # Text after calls that stay content is content too.
        self._in_call, self._seg, self._seg_is_content = False, "", calls is None
        self._parts, self._depth, self._in_str, self._escape = [], 0, False, False

    def _close(self, text: str, i: int) -> int:
        """Where the array closes in `text` (just after its `]`), or -1: the scan goes on in the
        next delta."""
        n = len(text)
        if self._escape and n:
            i, self._escape = 1, False
        while i < n:
            if self._in_str:
                m = _INSIDE.search(text, i)
                if m is None:
                    return -1
                if m.group() == '"':
                    self._in_str, i = False, m.end()
                elif m.end() < n:
                    i = m.end() + 1
                else:
                    self._escape = True
                    return -1
                continue
            m = _OUTSIDE.search(text, i)
            if m is None:
                return -1
            c, i = m.group(), m.end()
            if c == '"':
                self._in_str = True
            elif c in "[{":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    return i
        return -1

    def _parse(self, body: str) -> list[ToolCall] | None:
        try:
            arr = json.loads(body, parse_constant=no_constant)
        except (ValueError, RecursionError):
            return None
        if not isinstance(arr, list) or not arr:
            return None
        calls = [call_of(obj, "arguments", self.names, len(self.calls) + k, self.new_id)
                 for k, obj in enumerate(arr)]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
