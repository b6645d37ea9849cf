"""Tiny EAGLE-3 heads written to a folder in either checkpoint layout: the real key names and
config fields, downsized dims, seeded random weights, for a tiny target (`tiny_target_config`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pipeline.models.config import ModelConfig
from pipeline.models.tiny import tiny_config

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 4, 2, 16
DRAFT_VOCAB = 96


def tiny_target_config() -> ModelConfig:
    """8 layers: the default aux layers [2, 4, 5] are in range (2 layers' [2, 1, -1] are not)."""
    return tiny_config(num_layers=8)


def layer_config(target: ModelConfig, **overrides: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "model_type": "llama", "hidden_act": "silu", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "vocab_size": target.vocab_size, "tie_word_embeddings": False,
    }
    d.update(overrides)
    return d


def eagle_config(target: ModelConfig, **overrides: Any) -> dict[str, Any]:
    """SafeAILab/EAGLE's config.json: a Llama config plus `draft_vocab_size`."""
    d = layer_config(target)
    d.update({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB,
              "torch_dtype": "float32"})
    d.update(overrides)
    return d


def speculators_config(target: ModelConfig, layer: dict[str, Any] | None = None,
                       **overrides: Any) -> dict[str, Any]:
    """vLLM speculators' config.json (`Eagle3SpeculatorConfig`)."""
    d: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer or layer_config(target),
        "draft_vocab_size": DRAFT_VOCAB,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": None,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]},
        },
    }
    d.update(overrides)
    return d


def head_tensors(target: ModelConfig, seed: int = 0, draft_vocab: int = DRAFT_VOCAB,
                 with_embed: bool = False) -> dict[str, torch.Tensor]:
    """EAGLE-layout names (`midlayer.*`); `to_speculators` renames them."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) / shape[-1] ** 0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    a = "midlayer.self_attn."
    t = {"fc.weight": w(HIDDEN, 3 * target.hidden_size),
         a + "q_proj.weight": w(q, 2 * HIDDEN), a + "k_proj.weight": w(kv, 2 * HIDDEN),
         a + "v_proj.weight": w(kv, 2 * HIDDEN), a + "o_proj.weight": w(HIDDEN, q),
         "midlayer.mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
         "midlayer.mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
         "midlayer.mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
         "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
         "midlayer.post_attention_layernorm.weight": norm(), "norm.weight": norm(),
         "lm_head.weight": w(draft_vocab, HIDDEN)}
    # the draft vocabulary: a random sorted subset of the target's, as EAGLE-3 picks it
    picked = torch.randperm(target.vocab_size, generator=gen)[:draft_vocab].sort().values
    t["d2t"] = picked - torch.arange(draft_vocab)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[picked] = True
    t["t2d"] = t2d
    if with_embed:
        t["embed_tokens.weight"] = torch.randn((target.vocab_size, HIDDEN), generator=gen)
    return t


def to_speculators(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}


def write_head(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def write_layout(folder: Path, layout: str, target: ModelConfig, seed: int = 0,
                 with_embed: bool = False) -> Path:
    tensors = head_tensors(target, seed, with_embed=with_embed)
    if layout == "eagle":
        return write_head(folder, eagle_config(target), tensors)
    return write_head(folder, speculators_config(target), to_speculators(tensors))
