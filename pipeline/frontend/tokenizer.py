"""The tokenizer operations the front end needs. Client text (message content and names, text
prompts) has its special-token strings split into ordinary tokens, so it cannot forge a chat
turn: the template is rendered a second time with client strings replaced by markers, so that
only the template's own text is tokenized with special tokens."""

from __future__ import annotations

import json
import re
from typing import Any

from pipeline.frontend.errors import bad_request

_MARK = "\ue000{}\ue001"  # private-use characters
_MARKS = re.compile("\ue000(\\d+)\ue001")
_CLIENT_KEYS = ("content", "name")


class TokenizerAdapter:
    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._strs: dict[int, str] = {}
        self._specials: tuple[str, ...] | None = None

    def encode(self, text: str, add_special_tokens: bool = True,
               split_special_tokens: bool = False) -> list[int]:
        kwargs: dict[str, Any] = {"add_special_tokens": add_special_tokens}
        if split_special_tokens:
            kwargs["split_special_tokens"] = True
        try:
            return list(self.tok.encode(text, **kwargs))
        except TypeError:  # no such keywords: it parses no special text either
            return list(self.tok.encode(text))

    def special_texts(self) -> tuple[str, ...]:
        if self._specials is None:
            found = set(getattr(self.tok, "all_special_tokens", None) or [])
            for added in (getattr(self.tok, "added_tokens_decoder", None) or {}).values():
                if getattr(added, "special", False):
                    found.add(str(added.content))
            self._specials = tuple(sorted(s for s in found if s))
        return self._specials

    def holds_special_text(self, text: str) -> bool:
        return any(s in text for s in self.special_texts())

    def token_str(self, token_id: int) -> str:
        s = self._strs.get(token_id)
        if s is None:
            try:
                s = self.tok.decode([token_id], skip_special_tokens=False)
            except TypeError:
                s = self.tok.decode([token_id])
            self._strs[token_id] = s
        return s

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    split_special_tokens: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        if split_special_tokens:
            self._check_tool_texts(messages, tools)
        text = self._render(messages, add_generation_prompt, tools)
        if not split_special_tokens or not any(
                isinstance(m.get(k), str) and self.holds_special_text(m[k])
                for m in messages for k in _CLIENT_KEYS):
            return self.encode(text, add_special_tokens=False)
        values: list[str] = []
        marked = []
        for m in messages:
            m = dict(m)
            for key in _CLIENT_KEYS:
                if isinstance(m.get(key), str):
                    values.append(m[key])
                    m[key] = _MARK.format(len(values) - 1)
            marked.append(m)
        parts = _MARKS.split(self._render(marked, add_generation_prompt, tools))
        indices = [int(p) for p in parts[1::2]]
        if (sorted(indices) != list(range(len(values)))
                or "".join(values[int(p)] if i % 2 else p for i, p in enumerate(parts)) != text):
            raise bad_request("messages: a message holds special-token text and the chat "
                              "template changes message text, so it cannot be kept apart "
                              "from the template's markers; remove it or set "
                              "split_special_tokens to false", param="messages")
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids += self.encode(values[int(part)], add_special_tokens=False,
                                   split_special_tokens=True)
            elif part:
                ids += self.encode(part, add_special_tokens=False)
        return ids

    def _check_tool_texts(self, messages: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None) -> None:
        # Tool schemas and call arguments are rendered as JSON, with no marker to split them by.
        found = [("tools", tools)] + [(f"messages[{i}].tool_calls", m.get("tool_calls"))
                                      for i, m in enumerate(messages)]
        for param, value in found:
            if value and self.holds_special_text(json.dumps(value, ensure_ascii=False)):
                raise bad_request(f"{param}: holds special-token text; remove it or set "
                                  "split_special_tokens to false", param=param)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
        if getattr(self.tok, "chat_template", None):
            kwargs: dict[str, Any] = {"tools": tools} if tools else {}
            return self.tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")
