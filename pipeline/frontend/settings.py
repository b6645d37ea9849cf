"""The HTTP front end's settings (limits, API key, timeouts)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.output.tool_parsers import PARSERS

API_KEY_ENV = "SPECRELAY_API_KEY"


@dataclass
class ServerSettings:
    model_name: str | None = None  # served name; None: the engine's model_info()["name"]
    api_key: str | None = None  # None: read SPECRELAY_API_KEY; "" disables the check
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16 << 10
    request_timeout_s: float | None = 600.0
    retry_after_s: int = 1
    health_timeout_s: float = 2.0
    stats_timeout_s: float = 2.0
    max_choices_per_request: int = 64
    # True: a client's special-token text is tokenized as text, so it cannot forge chat turns.
    split_special_tokens: bool = True
    # "hermes", "llama3_json", "mistral": `tools` accepted and calls parsed (docs/tool-calling.md).
    tool_call_parser: str = "none"

    def __post_init__(self) -> None:
        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser: must be one of {', '.join(PARSERS)}, got "
                             f"{self.tool_call_parser!r}")

    def resolved_api_key(self) -> str | None:
        key = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV)
        return key or None
