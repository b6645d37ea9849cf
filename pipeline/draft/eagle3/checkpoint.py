"""Read an EAGLE-3 head from a local folder (config.json + safetensors, or pytorch_model.bin) in
either layout users have, checked against the target it will draft for:

- EAGLE (SafeAILab/EAGLE): a Llama config.json plus `draft_vocab_size` (optional
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`); the layer's tensors are `midlayer.*`.
- speculators (vLLM's): `speculators_model_type: eagle3`, the layer's config under
  `transformer_layer_config`, `speculators_config`; the layer's tensors are `layers.0.*`.

Both share `fc`, `norm`, `lm_head`, `d2t`, `t2d` and an optional `embed_tokens` (absent: the
head shares the target's embedding). Every mismatch is a ValueError naming the field."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch

from pipeline.draft.eagle3.head import Eagle3Config, Eagle3Head, default_aux_layers
from pipeline.models.config import ModelConfig

LAYOUTS = ("eagle", "speculators")
_LAYER_PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}
# checkpoint name (after the layer prefix) -> Eagle3Head name
_NORMS = {"input_layernorm.weight": "input_norm.weight", "hidden_norm.weight":
          "hidden_norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight"}


def read_head_config(d: dict[str, Any]) -> Eagle3Config:
    """From a head's config.json dict, either layout."""
    if "speculators_model_type" in d:
        if d["speculators_model_type"] != "eagle3":
            raise ValueError(f"speculators_model_type: expected 'eagle3', got "
                             f"{d['speculators_model_type']!r}")
        layout, layer_dict = "speculators", dict(d.get("transformer_layer_config") or {})
        if not layer_dict:
            raise ValueError("speculators checkpoint: config.json has no transformer_layer_config")
    else:
        layout, layer_dict = "eagle", dict(d)
        if "draft_vocab_size" not in d:
            raise ValueError("not an EAGLE-3 head: config.json has neither "
                             "speculators_model_type nor draft_vocab_size")
    layers = int(layer_dict.get("num_hidden_layers", 1))
    if layers != 1:
        raise ValueError(f"num_hidden_layers: an EAGLE-3 head here has 1 decoder layer, "
                         f"the checkpoint has {layers}")
    layer_dict["architectures"] = ["LlamaForCausalLM"]  # EAGLE's names the head, not the layer
    layer_dict.setdefault("num_hidden_layers", 1)
    layer = ModelConfig.from_hf_dict(layer_dict)
    aux = d.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=int(d.get("draft_vocab_size") or layer.vocab_size),
        target_hidden_size=int(d.get("target_hidden_size") or layer.hidden_size),
        aux_layer_ids=None if aux is None else [int(i) for i in aux],
        num_aux=3 if aux is None else len(aux),
        norm_before_residual=bool(d.get("norm_before_residual", False)),
        layout=layout)


def check_against_target(config: Eagle3Config, target: ModelConfig) -> list[int]:
    """The aux layer ids the target must capture; ValueError on any mismatch."""
    if config.target_hidden_size != target.hidden_size:
        field = "target_hidden_size" if config.target_hidden_size != config.hidden_size \
            else "hidden_size"
        raise ValueError(f"{field}: the head takes hidden states of size "
                         f"{config.target_hidden_size}, the target's hidden_size is "
                         f"{target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"vocab_size: the head's is {config.vocab_size}, the target's is "
                         f"{target.vocab_size}")
    if config.draft_vocab_size > config.vocab_size:
        raise ValueError(f"draft_vocab_size: {config.draft_vocab_size} is larger than the "
                         f"target's vocab_size {config.vocab_size}")
    ids = config.aux_layer_ids
    if ids is None:
        ids = default_aux_layers(target.num_layers)
        field = f"default aux layers [2, L//2, L-3] for num_layers={target.num_layers}"
    else:
        field = "eagle_aux_hidden_state_layer_ids"
    bad = [i for i in ids if not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(f"{field}: layer ids {bad} of {ids} are out of range for the target's "
                         f"num_layers={target.num_layers} (valid 0..{target.num_layers - 1})")
    return sorted(ids)  # the target captures, so concatenates, in layer order (as vLLM)


def expected_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, in `config.layout`'s names; `fc.bias` and
    `embed_tokens.weight` are optional, `d2t`/`t2d` too when the vocabularies are the same."""
    layer, hidden = config.layer, config.hidden_size
    p = _LAYER_PREFIX[config.layout]
    q_out, kv_out = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, config.num_aux * config.target_hidden_size),
        p + "self_attn.q_proj.weight": (q_out, 2 * hidden),
        p + "self_attn.k_proj.weight": (kv_out, 2 * hidden),
        p + "self_attn.v_proj.weight": (kv_out, 2 * hidden),
        p + "self_attn.o_proj.weight": (hidden, q_out),
        p + "mlp.gate_proj.weight": (layer.intermediate_size, hidden),
        p + "mlp.up_proj.weight": (layer.intermediate_size, hidden),
        p + "mlp.down_proj.weight": (hidden, layer.intermediate_size),
        "norm.weight": (hidden,),
        "lm_head.weight": (config.draft_vocab_size, hidden),
        "d2t": (config.draft_vocab_size,),
        "t2d": (config.vocab_size,),
        "embed_tokens.weight": (config.vocab_size, hidden),
        "fc.bias": (hidden,),
    }
    for name in _NORMS:
        shapes[p + name] = (hidden,)
    if layer.attention_bias:
        shapes.update({p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias":
                       (kv_out,), p + "self_attn.v_proj.bias": (kv_out,)})
    return shapes


def check_tensors(config: Eagle3Config, tensors: dict[str, torch.Tensor]) -> None:
    shapes = expected_shapes(config)
    optional = {"fc.bias", "embed_tokens.weight"}
    if config.draft_vocab_size == config.vocab_size:
        optional |= {"d2t", "t2d"}
    missing = sorted(set(shapes) - set(tensors) - optional)
    if missing:
        raise ValueError(f"{config.layout} checkpoint is missing tensors {missing}")
    unknown = sorted(set(tensors) - set(shapes))
    if unknown:
        raise ValueError(f"{config.layout} checkpoint has unknown tensors {unknown}")
    wrong = [f"{name}: expected {list(shapes[name])}, the checkpoint has {list(t.shape)}"
             for name, t in tensors.items() if tuple(t.shape) != shapes[name]]
    if wrong:
        raise ValueError(f"{config.layout} checkpoint tensor shapes differ from its config: "
                         + "; ".join(wrong))
    if "d2t" in tensors:
        target_ids = torch.arange(config.draft_vocab_size) + tensors["d2t"].long()
        bad = ((target_ids < 0) | (target_ids >= config.vocab_size)).nonzero().flatten()
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"d2t: draft id {i} maps to target id {int(target_ids[i])}, "
                             f"outside the target's vocab_size {config.vocab_size}")
        if "t2d" in tensors and not tensors["t2d"].bool()[target_ids].all():
            raise ValueError("t2d: does not mark every target id that d2t maps to")


def to_head_state(config: Eagle3Config, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    p = _LAYER_PREFIX[config.layout]
    a = p + "self_attn."
    state = {
        "fc.weight": t["fc.weight"],
        "attn.wqkv.weight": torch.cat([t[a + "q_proj.weight"], t[a + "k_proj.weight"],
                                       t[a + "v_proj.weight"]]),
        "attn.wo.weight": t[a + "o_proj.weight"],
        "mlp.w_gate_up.weight": torch.cat([t[p + "mlp.gate_proj.weight"],
                                           t[p + "mlp.up_proj.weight"]]),
        "mlp.w_down.weight": t[p + "mlp.down_proj.weight"],
        "norm.weight": t["norm.weight"],
        "lm_head.weight": t["lm_head.weight"],
    }
    state.update({ours: t[p + theirs] for theirs, ours in _NORMS.items()})
    if config.layer.attention_bias:
        state["attn.wqkv.bias"] = torch.cat([t[a + "q_proj.bias"], t[a + "k_proj.bias"],
                                             t[a + "v_proj.bias"]])
    if config.fc_bias:
        state["fc.bias"] = t["fc.bias"]
    return state


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors.torch import load_file
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(f))
        return out
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if bins:
        out = {}
        for f in bins:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        return out
    raise ValueError(f"no EAGLE-3 head weights in {path} (*.safetensors or pytorch_model.bin)")


def load_eagle3_head(path: str, target: ModelConfig, target_embed: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """`target_embed`: the target's input embedding, shared when the checkpoint has none."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"no config.json in EAGLE-3 head folder {path}")
    with open(config_path) as f:
        config = read_head_config(json.load(f))
    config.aux_layer_ids = check_against_target(config, target)
    tensors = read_tensors(path)
    check_tensors(config, tensors)
    config.fc_bias = "fc.bias" in tensors
    state = to_head_state(config, tensors)
    embed = tensors.get("embed_tokens.weight")
    if embed is None:
        if target_embed is None:
            raise ValueError("embed_tokens: the checkpoint has none and no target embedding "
                             "was given to share")
        if tuple(target_embed.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"embed_tokens: the checkpoint has none; the target's embedding "
                             f"is {list(target_embed.shape)}, the head needs "
                             f"{[config.vocab_size, config.hidden_size]}")
        embed = target_embed
    state["embed.weight"] = embed
    state = {k: v.detach().to(dtype) for k, v in state.items()}
    state["d2t"] = tensors.get("d2t", torch.zeros(config.draft_vocab_size)).long()
    state["t2d"] = tensors.get("t2d", torch.ones(config.vocab_size)).bool()
    with torch.device("meta"):
        head = Eagle3Head(config)
    head.load_state_dict(state, strict=True, assign=True)
    return head.eval()
