"""Model configuration for the Llama family (SmolLM2, Llama 2/3, Qwen2)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass
class ModelConfig:
    """`rope_scaling`: None or a Llama-3 style dict ("rope_type": "llama3", "factor", ...).
    `attention_bias`: a bias on the q/k/v projections (Qwen2); o_proj never has one."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(f"ModelConfig.rope_scaling: unsupported rope_type {kind!r} "
                                 "(supported: 'llama3', 'default')")
            if kind == "default":
                self.rope_scaling = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        archs = d.get("architectures") or [_arch_from_model_type(d.get("model_type"))]
        arch = archs[0]
        if arch not in SUPPORTED_HF_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_HF_ARCHITECTURES)}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d.get('hidden_act')!r} (need 'silu')")
        if arch == "MistralForCausalLM" and d.get("sliding_window"):
            raise ValueError("unsupported: Mistral sliding-window attention")
        if d.get("mlp_bias"):
            raise ValueError("unsupported: mlp_bias=true (MLP projections with bias)")
        if arch != "Qwen2ForCausalLM" and d.get("attention_bias"):
            # HF Llama then also puts a bias on o_proj, which this model does not have.
            raise ValueError(f"unsupported: {arch} with attention_bias=true (o_proj bias)")
        # transformers 5 folds rope_theta and rope_scaling into `rope_parameters`.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = float(d.get("rope_theta", rope.pop("rope_theta", 10000.0)))
        rope.pop("rope_theta", None)
        kind = rope.get("rope_type", rope.get("type"))
        scaling = None if kind in (None, "default") else rope
        heads = int(d["num_attention_heads"])
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else
                                          [int(e) for e in eos])
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )


def _arch_from_model_type(model_type: str | None) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM"}.get(model_type or "", str(model_type))
