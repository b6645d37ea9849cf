"""Model layer: Llama-family model, block-paged KV cache, attention backends, loaders, 4-bit
weights, tensor parallelism, and the runner over them."""

from pipeline.models.config import ModelConfig
from pipeline.models.kv_cache import CacheFullError, KVCache
from pipeline.models.runner import ModelRunner
from pipeline.models.runners import load_runner

__all__ = ["CacheFullError", "KVCache", "ModelConfig", "ModelRunner", "load_runner"]
