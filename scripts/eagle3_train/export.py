"""Write a trained head in the EAGLE repo's layout (`config.json` with `draft_vocab_size`,
`midlayer.*` tensors), which `load_eagle3_head` reads, vLLM and SGLang too. No `embed_tokens`:
the head shares the target's."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from pipeline.draft.eagle3.head import Eagle3Head


def eagle_config(head: Eagle3Head, dtype: torch.dtype) -> dict[str, Any]:
    c, layer = head.config, head.config.layer
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_act": "silu", "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_attention_heads": layer.num_heads, "num_key_value_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": layer.rms_norm_eps, "rope_theta": layer.rope_theta,
        "max_position_embeddings": layer.max_position_embeddings,
        "vocab_size": layer.vocab_size, "tie_word_embeddings": False,
        "bos_token_id": layer.bos_token_id, "eos_token_id": layer.eos_token_ids,
        "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(head.aux_layer_ids),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def eagle_tensors(head: Eagle3Head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    layer = head.config.layer
    q_out, kv_out = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    q, k, v = head.attn.wqkv.weight.detach().split([q_out, kv_out, kv_out])
    gate, up = head.mlp.w_gate_up.weight.detach().split(layer.intermediate_size)
    m, a = "midlayer.", "midlayer.self_attn."
    t = {"fc.weight": head.fc.weight, a + "q_proj.weight": q, a + "k_proj.weight": k,
         a + "v_proj.weight": v, a + "o_proj.weight": head.attn.wo.weight,
         m + "mlp.gate_proj.weight": gate, m + "mlp.up_proj.weight": up,
         m + "mlp.down_proj.weight": head.mlp.w_down.weight,
         m + "input_layernorm.weight": head.input_norm.weight,
         m + "hidden_norm.weight": head.hidden_norm.weight,
         m + "post_attention_layernorm.weight": head.mlp_norm.weight,
         "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight}
    out = {name: w.detach().to(dtype).contiguous() for name, w in t.items()}
    out["d2t"] = head.d2t.detach().clone()
    out["t2d"] = head.t2d.detach().clone()
    return out


def export_head(head: Eagle3Head, folder: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Returns the weights file's size in bytes."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(eagle_config(head, dtype), f, indent=2)
        f.write("\n")
    path = os.path.join(folder, "model.safetensors")
    save_file(eagle_tensors(head, dtype), path)
    return os.path.getsize(path)
