"""What an engine says about its model (`model_info()`), for the front end and batch jobs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.config import EngineConfig


def model_info(config: EngineConfig, loaded: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": config.served_name,
        "source": config.model,
        "max_model_len": config.max_model_len,
        "vocab_size": loaded.get("vocab_size"),
        "eos_token_ids": loaded.get("eos_token_ids", []),
        "draft": config.draft,
        "num_speculative_tokens": config.num_speculative_tokens,
        "tensor_parallel_size": config.tensor_parallel_size,
    }
