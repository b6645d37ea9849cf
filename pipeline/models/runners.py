"""ModelRunners (target, one TP rank of it, or the draft) and the tokenizer for an EngineConfig."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.config import EngineConfig, is_tiny, resolve_source
from pipeline.models.factory import load_runner
from pipeline.models.runner import ModelRunner
from pipeline.models.tiny import tiny_config
from pipeline.tiny_tokenizer import ByteTokenizer
from pipeline.tokenizer import load_tokenizer


def set_torch_threads(config: EngineConfig) -> None:
    """Apply `torch_threads` in this process (each stage actor calls it before building)."""
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)


def build_runner(config: EngineConfig, role: str = "target", tp_rank: int = 0,
                 tp_world: int = 1) -> ModelRunner:
    """A runner over the target (`role="target"`, one TP shard when tp_world > 1) or the draft.

    `tiny:<seed>` is the seeded random pair of pipeline.models.tiny: the draft is the target with
    `draft_agreement_noise` weight noise, so each actor can build its half on its own."""
    source = config.model if role == "target" else config.draft_model
    if source is None:
        raise ValueError(f"draft_model: no model source for role {role!r}")
    noise = config.draft_agreement_noise if role == "draft" and is_tiny(source) else 0.0
    runner = load_runner(
        source if is_tiny(source) else resolve_source(source), num_slots=config.num_seqs,
        max_len=config.max_model_len, device=config.device, dtype=config.dtype,
        backend=config.attention_backend, agreement_noise=noise, tp_rank=tp_rank,
        tp_size=tp_world, load_tokenizer=role == "target", block_size=config.block_size,
        kv_cache_tokens=config.kv_blocks * config.block_size,
        prefix_caching=config.enable_prefix_caching,
    )
    if runner.tokenizer is None and is_tiny(source):
        runner.tokenizer = tiny_tokenizer()
    return runner


def load_engine_tokenizer(config: EngineConfig) -> Any:
    """The target's tokenizer without loading weights (for the output actor and the CLI)."""
    if is_tiny(config.model):
        return tiny_tokenizer()
    return load_tokenizer(resolve_source(config.model))


def tiny_tokenizer() -> Any:
    return ByteTokenizer(tiny_config().eos_token_ids)
