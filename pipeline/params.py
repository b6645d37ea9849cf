"""Per-request sampling and stopping parameters (OpenAI / vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline import validate as check

GRAMMAR_KINDS = ("json_schema", "regex", "choice", "lark")

# Bounds that keep one request from costing the server unbounded work or memory.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_NEW_TOKENS_LIMIT = 1 << 20
MAX_SEED = (1 << 63) - 1
MAX_TEMPERATURE = 2.0  # OpenAI's range


@dataclass(frozen=True)
class Grammar:
    """llguidance's compiled grammar text, as plain data so stages and the protocol can hold one
    without llguidance."""

    kind: str
    compiled: str


@dataclass
class SamplingParams:
    """Construction validates: a bad value raises ValueError naming the field."""

    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-N per token; 0 = only the chosen token's logprob
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = disabled
    seed: int | None = None
    min_new_tokens: int = 0
    # A `Grammar`, or (output side only) a zero-argument factory of matchers with
    # `accept_token(token_id) -> bool` and `is_terminated() -> bool`.
    grammar: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        check.integer("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        check.integer("min_new_tokens", self.min_new_tokens, 0, self.max_new_tokens)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError("stop: every stop string must be a non-empty string")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop: a stop string is longer than {MAX_STOP_STRING_CHARS} chars")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            check.integer("stop_token_ids", t, 0, (1 << 31) - 1)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean")
        if self.logprobs is not None:
            check.integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        check.number("temperature", self.temperature, lo=0, hi=MAX_TEMPERATURE)
        check.number("top_p", self.top_p, lo=0, hi=1, lo_open=True)
        check.integer("top_k", self.top_k, -1, 1 << 31)
        if self.seed is not None:
            check.integer("seed", self.seed, 0, MAX_SEED)
        if (self.grammar is not None and not callable(self.grammar)
                and not isinstance(self.grammar, Grammar)):
            raise ValueError("grammar: must be a compiled Grammar or a matcher factory")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
