"""Tool calls of a choice whose grammar forces them (`tool_choice` required or named): every call
is a JSON object that parses, so a call is announced once its name is known and its arguments
are streamed as they are generated, whatever the parser's markup around the objects."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import replace

from pipeline.output.tool_calls import ToolCall, ToolDelta, ToolStream

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes and Mistral; Llama 3


class ForcedCallStream(ToolStream):
    """`feed` text deltas, then `finish`. Text outside the call objects is the parser's markup
    (the grammar allows nothing else) and is never content. A call cut off by `max_tokens` keeps
    the arguments sent so far, and the choice's finish reason says `length`."""

    def __init__(self, names: Collection[str] | None = None,
                 new_id: Callable[[int], str] = lambda i: f"call_{i}") -> None:
        super().__init__(names, new_id)
        self._depth = 0
        self._in_str = self._escaped = False
        self._phase = "key"  # where a depth-1 character is: "key", "colon" or "value"
        self._key: list[str] = []
        self._field = ""  # the depth-1 key whose value is being read
        self._name: list[str] = []  # raw JSON string text
        self._in_args = False
        self._args: list[str] = []  # argument text not yet sent
        self._call: ToolCall | None = None  # the announced call being read

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        for ch in text:
            self._step(ch, out)
        self._flush(out)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        self._flush(out)
        return out

    def _step(self, ch: str, out: ToolDelta) -> None:
        depth = self._depth
        if depth == 0:
            if ch == "{":
                self._depth, self._phase, self._field, self._call = 1, "key", "", None
                self._name.clear()
            return
        if self._in_args:
            self._args.append(ch)
        if self._in_str:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_str = False
                if depth == 1 and self._phase == "key":
                    self._phase, self._field = "colon", "".join(self._key)
                elif depth == 1 and self._field == "name":
                    self._announce(out)
                return
            if depth == 1 and self._phase == "key":
                self._key.append(ch)
            elif depth == 1 and self._field == "name":
                self._name.append(ch)
            return
        if ch == '"':
            self._in_str = True
            if depth == 1 and self._phase == "key":
                self._key.clear()
        elif ch in "{[":
            if depth == 1 and self._field in ARGUMENT_KEYS and not self._in_args:
                self._in_args = True
                self._args.append(ch)
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._in_args = False
            elif self._depth == 0:
                self._flush(out)
                self._call = None
        elif depth == 1 and ch == ":":
            self._phase = "value"
        elif depth == 1 and ch == ",":
            self._phase, self._field = "key", ""

    def _announce(self, out: ToolDelta) -> None:
        if self._call is not None:
            return
        index = len(self.calls)
        name = json.loads('"' + "".join(self._name) + '"')
        self._call = ToolCall(index, self.new_id(index), name, "")
        self.calls.append(self._call)
        out.calls.append(self._call)

    def _flush(self, out: ToolDelta) -> None:
        """The argument text read so far: inside the call if it was announced in `out`, else as
        a fragment (arguments read before the name wait for it)."""
        if not self._args or self._call is None:
            return
        text = "".join(self._args)
        self._args.clear()
        if out.calls and out.calls[-1] is self._call:
            self._call = replace(self._call, arguments=self._call.arguments + text)
            out.calls[-1] = self.calls[-1] = self._call
        else:
            out.args.append((self._call.index, text))
