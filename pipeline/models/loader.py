"""Load weights, config and tokenizer from a GGUF file or a Hugging Face folder. Both readers
give Hugging Face tensor names; `hf_to_internal` fuses them into `LlamaModel`'s layout."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import pipeline.tokenizer
from pipeline import file_cache
from pipeline.config import QUANTIZATIONS, WEIGHTS
from pipeline.models.config import ModelConfig
from pipeline.models.llama import LlamaModel
from pipeline.models.quant import GroupQuant, Int4Linear, gguf_group_quant, quantize_linears

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Any | None
    chat_template: str | None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_model(path: str, dtype: str | torch.dtype = torch.float32,
               load_tokenizer: bool = True, weights: str = "float",
               quantization: str | None = None) -> LoadedModel:
    """`weights` (GGUF): "quantized" keeps 4-bit tensors 4-bit, "float" dequantizes to `dtype`.
    `quantization` (HF folders): "int4" quantizes the projections at load (Q4_1's scheme)."""
    dtype = resolve_dtype(dtype)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {list(WEIGHTS)}, got {weights!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        config, tensors = read_hf_folder(path)
        tokenizer = _tokenizer(path) if load_tokenizer else None
    elif path.endswith(".gguf"):
        config, tensors = read_gguf(path, quantized=weights == "quantized")
        tokenizer = _tokenizer(path) if load_tokenizer else None
    else:
        raise ValueError(f"not a model: {path} (expected a .gguf file or a Hugging Face folder)")
    model = build_model(config, tensors, dtype)
    if quantization == "int4" and os.path.isdir(path):
        quantize_linears(model)
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return LoadedModel(model, config, tokenizer, template)


def build_model(config: ModelConfig, hf_tensors: dict[str, torch.Tensor | GroupQuant],
                dtype: torch.dtype) -> LlamaModel:
    state = hf_to_internal(hf_tensors, config)
    with torch.device("meta"):
        model = LlamaModel(config)
    for key in [k for k, v in state.items() if isinstance(v, GroupQuant)]:
        path = key.removesuffix(".weight")
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name,
                Int4Linear(state.pop(key), state.get(path + ".bias")))
    state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def hf_to_internal(t: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    def get(name: str) -> torch.Tensor:
        if name not in t:
            raise ValueError(f"weights are missing tensor {name!r}")
        return t[name]

    out = {"embed.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    for i in range(config.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        out[o + "attn.wqkv.weight"] = _cat_rows(
            [get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")])
        if config.attention_bias:
            out[o + "attn.wqkv.bias"] = torch.cat(
                [get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
        out[o + "attn.wo.weight"] = get(a + "o_proj.weight")
        out[o + "mlp.w_gate_up.weight"] = _cat_rows(
            [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        out[o + "mlp.w_down.weight"] = get(p + "mlp.down_proj.weight")
        out[o + "attn_norm.weight"] = get(p + "input_layernorm.weight")
        out[o + "mlp_norm.weight"] = get(p + "post_attention_layernorm.weight")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    return out


def _cat_rows(parts: list[torch.Tensor | GroupQuant]) -> torch.Tensor | GroupQuant:
    """4-bit when every part is (a Q6_K v beside Q4_K q/k: float)."""
    if all(isinstance(p, GroupQuant) for p in parts):
        return GroupQuant.cat(parts)
    return torch.cat([p.dequantize() if isinstance(p, GroupQuant) else p for p in parts])


def read_hf_folder(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in model folder {path}")
    with open(cfg_path) as f:
        config = ModelConfig.from_hf_dict(json.load(f))
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {path}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(os.path.join(path, name)))
    if config.tie_word_embeddings is False and "lm_head.weight" not in tensors:
        raise ValueError(f"{path}: config says untied embeddings but lm_head.weight is missing")
    return config, tensors


def _tokenizer(path: str) -> Any | None:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, n)) for n in names):
        return None
    return pipeline.tokenizer.load_tokenizer(path)


def _supported_quant_types() -> set[Any]:
    from gguf import GGMLQuantizationType as Q

    return {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
            Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: Any, path: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported architecture {arch!r}; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    scaling = None
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{path}: unsupported GGUF rope scaling "
                         f"{_field(reader, f'{arch}.rope.scaling.type')!r}")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings=tied,
        attention_bias=arch == "qwen2",
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        architecture=GGUF_ARCHITECTURES[arch],
    )


_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_TO_HF:
        return f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs per head), so the
    rotate-half RoPE of HF and `llama.py` applies. Qwen2 files are not permuted."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def read_gguf(path: str, quantized: bool = False
              ) -> tuple[ModelConfig, dict[str, torch.Tensor | GroupQuant]]:
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    versions = [importlib.metadata.version("gguf"), str(_TABLE_FORMAT)]
    cached = file_cache.entry_path("gguf-table", path, versions)
    table = _read_table(cached) if cached is not None else None
    if table is None:
        table = gguf_table(gguf.GGUFReader(path), path)
        if cached is not None:
            file_cache.publish(cached, lambda folder: _write_table(folder, table))
    config = ModelConfig(**table["config"])
    data = np.memmap(path, mode="r")
    tensors: dict[str, torch.Tensor | GroupQuant] = {}
    for t in table["tensors"]:
        raw = data[t["offset"]:t["offset"] + t["bytes"]].view(np.dtype(t["dtype"]))
        # The token table stays float: as a tied LM head, torch's int8/int4 kernels would give
        # bfloat16 logits (ties, coarse logprobs).
        embedding = t["hf"] == "model.embed_tokens.weight"
        if quantized and t["type"] in _GROUP_QUANT_TYPES and not embedding:
            gq = gguf_group_quant(raw.reshape(t["shape"]), t["type"], _logical_shape(t))
            if t["unpermute_heads"]:
                gq = gq.rows(torch.from_numpy(
                    unpermute_rope_rows(np.arange(gq.shape[0]), t["unpermute_heads"])))
            tensors[t["hf"]] = gq
            continue
        w = np.asarray(gguf.quants.dequantize(raw.reshape(t["shape"]),
                                              gguf.GGMLQuantizationType(t["type"])),
                       dtype=np.float32)
        if t["unpermute_heads"]:
            w = unpermute_rope_rows(w, t["unpermute_heads"])
        tensors[t["hf"]] = torch.from_numpy(np.array(w, dtype=np.float32))  # writable copy
    return config, tensors


_GROUP_QUANT_TYPES = (2, 3, 12)  # GGMLQuantizationType Q4_0, Q4_1, Q4_K


def _logical_shape(t: dict[str, Any]) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t["type"])]
    rows, nbytes = t["shape"]
    return rows, nbytes // size * block


_TABLE_FORMAT = 1  # bump when the table's fields change


def gguf_table(reader: Any, path: str) -> dict[str, Any]:
    """What loading needs from a GGUF besides the weights' bytes (cached per file). Validates
    like a load does, so nothing unsupported is ever cached."""
    config = gguf_config(reader, path)
    arch = _field(reader, "general.architecture")
    supported = _supported_quant_types()
    tensors = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise ValueError(f"{path}: unsupported GGUF rope_freqs tensor (Llama-3.1 style rope "
                             "scaling); load the Hugging Face folder of this model instead")
        hf = _hf_name(t.name)
        if hf is None:
            continue
        if t.tensor_type not in supported:
            raise ValueError(f"{path}: tensor {t.name} has unsupported quantization type "
                             f"{t.tensor_type.name}; supported: "
                             f"{', '.join(sorted(q.name for q in supported))}")
        heads = 0
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight",
                                                "attn_q.bias", "attn_k.bias")):
            kv = t.name.endswith(("attn_k.weight", "attn_k.bias"))
            heads = config.num_kv_heads if kv else config.num_heads
        tensors.append({"hf": hf, "type": int(t.tensor_type), "offset": int(t.data_offset),
                        "bytes": int(t.data.nbytes), "dtype": t.data.dtype.str,
                        "shape": list(t.data.shape), "unpermute_heads": heads})
    return {"config": config.to_dict(), "tensors": tensors}


def _write_table(folder: str, table: dict[str, Any]) -> None:
    with open(os.path.join(folder, "table.json"), "w") as f:
        json.dump(table, f)


def _read_table(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, "table.json")) as f:
            return json.load(f)
    except (OSError, ValueError):  # absent or damaged: read the GGUF
        return None
