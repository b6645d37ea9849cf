"""Tiny Llama/Qwen2 models written as GGUF files the way llama.cpp's converter writes them."""

from __future__ import annotations

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q

HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}

def _llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to q/k rows of llama models."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{HF_TO_GGUF[module]}.{kind}"


def hf_model(arch: str, seed: int = 0):
    common = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "rope_theta": 10000.0,
              "tie_word_embeddings": False}
    cls, cfg = ((transformers.LlamaForCausalLM, transformers.LlamaConfig) if arch == "llama"
                else (transformers.Qwen2ForCausalLM, transformers.Qwen2Config))
    torch.manual_seed(seed)
    model = cls(cfg(**common)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.2 if "norm" in name or p.dim() == 1 else p.shape[-1] ** -0.5
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=gen))
    return model


def write_gguf(path, hf_model, arch: str, qtype=Q.F32, bad_type=None,
                extra: dict[str, np.ndarray] | None = None) -> None:
    """Write `hf_model` as llama.cpp would. With a quantized `qtype`, `hf_model`'s 2-D weights
    are replaced by their quantize/dequantize round trip so HF stays the exact reference."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, p in hf_model.state_dict().items():
        if bad_type is not None and _gguf_name(name) == "blk.0.attn_q.weight":
            continue  # written below with the unsupported type
        a = p.detach().numpy().astype(np.float32)
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            a = _llamacpp_permute(a, heads)
        if a.ndim == 2 and qtype != Q.F32:
            raw = gguf.quants.quantize(a, qtype)
            with torch.no_grad():  # make HF hold exactly what the file holds
                back = gguf.quants.dequantize(raw, qtype)
                if arch == "llama" and ("q_proj" in name or "k_proj" in name):
                    back = _unpermute(back, heads)
                p.copy_(torch.from_numpy(np.array(back)))
            w.add_tensor(_gguf_name(name), raw, raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), a)
    if bad_type is not None:
        _block, size = gguf.GGML_QUANT_SIZES[bad_type]  # one block per row
        w.add_tensor("blk.0.attn_q.weight", np.zeros((64, size), np.uint8), raw_dtype=bad_type)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _unpermute(a: np.ndarray, heads: int) -> np.ndarray:
    return a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2) \
        .reshape(a.shape)
