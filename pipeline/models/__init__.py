"""Model layer: Llama-family model, slot KV cache, attention backends, loaders, TP, runner."""

from pipeline.models.config import ModelConfig
from pipeline.models.factory import load_runner
from pipeline.models.kv_cache import CacheFullError, KVCache
from pipeline.models.runner import ModelRunner

__all__ = ["CacheFullError", "KVCache", "ModelConfig", "ModelRunner", "load_runner"]
