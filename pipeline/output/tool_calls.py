"""Hermes / Qwen2.5 tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) parsed
from a choice's text deltas as they arrive (docs/tool-calling.md). Text before a call start is
content, held only while its end could be the start of a marker; a call is sent whole once it
closes and parses, so one that does not parse is content, never a broken `tool_calls` entry."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object's text

    def openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # new calls, with their arguments so far
    args: list[tuple[int, str]] = field(default_factory=list)  # more of announced calls' arguments

    def add(self, other: ToolDelta) -> None:
        self.content += other.content
        self.calls += other.calls
        self.args += other.args


def partial_marker(text: str, marker: str = START) -> int:
    """The longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolStream:
    """What every parser keeps: the tools it may call, how it names calls, what it sent, and the
    text between calls (`_outside`)."""

    def __init__(self, names: Collection[str] | None = None,
                 new_id: Callable[[int], str] = lambda i: f"call_{i}") -> None:
        self.names = None if names is None else frozenset(names)
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self.content = ""
        self._seg = ""  # whitespace after a call, dropped unless more text follows
        self._seg_is_content = True  # the text before the first call always is

    def _outside(self, out: ToolDelta, text: str, closing: bool) -> None:
        if self._seg_is_content or text.strip():
            out.content += self._seg + text
            self._seg, self._seg_is_content = "", True
        else:
            self._seg += text
        if closing:
            self._seg = ""


class HermesStream(ToolStream):
    """`feed` each text delta, then `finish`; the deltas' concatenation is the same however the
    text was cut. After the first call, whitespace between calls is dropped; other text there
    stays content."""

    def __init__(self, names: Collection[str] | None = None,
                 new_id: Callable[[int], str] = lambda i: f"call_{i}") -> None:
        super().__init__(names, new_id)
        self._buf = ""
        self._in_call = False
        # A call's text arrives in `_parts`, joined only once END may be in it: long arguments
        # stay linear. `_tail`: the call text's last len(END) - 1 characters.
        self._parts: list[str] = []
        self._tail = ""

    def feed(self, text: str) -> ToolDelta:
        if self._in_call and END not in self._tail + text:
            self._parts.append(text)
            self._tail = (self._tail + text)[1 - len(END):]
            return ToolDelta()
        self._join(text)
        return self._drain(final=False)

    def finish(self) -> ToolDelta:
        self._join("")
        return self._drain(final=True)

    def _join(self, text: str) -> None:
        if self._parts:
            self._parts.append(text)
            self._buf += "".join(self._parts)
            self._parts.clear()
        else:
            self._buf += text

    def _drain(self, final: bool) -> ToolDelta:
        out = ToolDelta()
        while True:
            if self._in_call:
                j = self._buf.find(END)
                if j < 0:
                    self._tail = self._buf[1 - len(END):]
                    if final:  # never closed: the raw text is content
                        out.content += START + self._buf
                        self._buf = ""
                    break
                body, self._buf = self._buf[:j], self._buf[j + len(END):]
                call = self._parse(body)
                # Text after a call that stays content is content too.
                self._in_call, self._seg, self._seg_is_content = False, "", call is None
                if call is None:
                    out.content += START + body + END
                else:
                    out.calls.append(call)
                    self.calls.append(call)
                continue
            i = self._buf.find(START)
            if i >= 0:
                self._outside(out, self._buf[:i], closing=True)
                self._buf, self._in_call = self._buf[i + len(START):], True
                continue
            keep = 0 if final else partial_marker(self._buf)
            cut = len(self._buf) - keep
            self._outside(out, self._buf[:cut], closing=final)
            self._buf = self._buf[cut:]
            break
        self.content += out.content
        return out

    def _parse(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body, parse_constant=no_constant)
        except (ValueError, RecursionError):
            return None
        return call_of(obj, "arguments", self.names, len(self.calls), self.new_id)


def call_of(obj: object, args_key: str, names: frozenset[str] | None, index: int,
            new_id: Callable[[int], str]) -> ToolCall | None:
    """A parsed `{"name": ..., args_key: {...}}` as the call at `index`, or None."""
    if not isinstance(obj, dict) or set(obj) - {"name", args_key}:
        return None
    name, args = obj.get("name"), obj.get(args_key, {})
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    if names is not None and name not in names:
        return None
    return ToolCall(index, new_id(index), name, json.dumps(args, ensure_ascii=False))


def no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_tool_calls(text: str, names: Collection[str] | None = None) -> ToolDelta:
    """The whole-text parse: what the streamed deltas add up to."""
    stream = HermesStream(names)
    out = stream.feed(text)
    out.add(stream.finish())
    return out
