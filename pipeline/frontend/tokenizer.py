"""The few tokenizer operations the front end needs, over an HF or the tiny byte tokenizer."""

from __future__ import annotations

from typing import Any


class TokenizerAdapter:
    """Prompt encoding, chat templates and (cached) one-token strings for logprob tables."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._strs: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.tok.encode(text, add_special_tokens=add_special_tokens))
        except TypeError:  # tokenizers without the keyword
            return list(self.tok.encode(text))

    def token_str(self, token_id: int) -> str:
        s = self._strs.get(token_id)
        if s is None:
            try:
                s = self.tok.decode([token_id], skip_special_tokens=False)
            except TypeError:
                s = self.tok.decode([token_id])
            self._strs[token_id] = s
        return s

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """The model's chat template applied to `messages` (a plain fallback without one)."""
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            text += "assistant:" if add_generation_prompt else ""
        # The template already holds the special tokens it wants.
        return self.encode(text, add_special_tokens=False)
