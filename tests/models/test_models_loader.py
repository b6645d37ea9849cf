"""Loaders: GGUF (written here from a tiny HF model, incl. llama.cpp's q/k permutation and a
quantized type), Hugging Face folders, and their error messages; `load_runner` sources."""

from __future__ import annotations

import json
import os
import random
import time

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from pipeline.models import CacheFullError, load_runner
from pipeline.models.loader import load_model
from pipeline.models.runner import ModelRunner

HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_RNG = random.Random(4)
IDS = [_RNG.randrange(320) for _ in range(41)]


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


def _hf_model(arch: str, seed: int = 0):
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


def _write_gguf(path, hf_model, arch: str, qtype=Q.F32, bad_type=None,
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


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    return runner.forward([runner.allocate()], [ids])[0]


@pytest.mark.parametrize("arch, qtype", [("llama", Q.F32), ("llama", Q.Q8_0), ("qwen2", Q.F32),
                                         ("llama", Q.Q4_1)])
def test_gguf_logits_match_hf(tmp_path, arch, qtype):
    hf = _hf_model(arch)
    path = tmp_path / "m.gguf"
    _write_gguf(path, hf, arch, qtype)
    loaded = load_model(str(path), load_tokenizer=False)
    assert loaded.config.architecture == ("LlamaForCausalLM" if arch == "llama"
                                          else "Qwen2ForCausalLM")
    assert loaded.config.attention_bias is (arch == "qwen2")
    assert loaded.config.eos_token_ids == [2]
    runner = ModelRunner(loaded.model, loaded.config, 1, 64)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    assert ref.abs().max() > 1.0
    assert (_logits(runner, IDS) - ref).abs().max() < 1e-4


def test_gguf_unsupported_quant_type_is_named(tmp_path):
    hf = _hf_model("llama")
    path = tmp_path / "bad.gguf"
    _write_gguf(path, hf, "llama", bad_type=Q.IQ2_XXS)
    with pytest.raises(ValueError, match="unsupported quantization type IQ2_XXS"):
        load_model(str(path), load_tokenizer=False)


def test_gguf_rope_freqs_scaling_is_rejected(tmp_path):
    path = tmp_path / "llama31.gguf"
    _write_gguf(path, _hf_model("llama"), "llama",
                extra={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="unsupported GGUF rope_freqs"):
        load_model(str(path), load_tokenizer=False)


def test_gguf_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(str(path), load_tokenizer=False)


def test_missing_files_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(_hf_model("llama").config.to_dict()))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_hf_folder_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["FalconForCausalLM"], "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported architecture 'FalconForCausalLM'"):
        load_model(str(tmp_path))


def test_bad_dtype_and_non_model_path(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(str(tmp_path), dtype="int8")
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_model(str(f))


def test_load_runner_hf_folder_bfloat16(tmp_path):
    hf = _hf_model("llama", seed=5)
    hf.save_pretrained(tmp_path)
    runner = load_runner(str(tmp_path), num_slots=2, max_len=64, dtype="bfloat16")
    assert runner.dtype == torch.bfloat16 and runner.tokenizer is None
    assert runner.cache.k[0].dtype == torch.bfloat16
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    got = _logits(runner, IDS)
    assert got.dtype == torch.float32
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_load_runner_tiny_sources():
    target = load_runner("tiny:3", num_slots=2, max_len=32)
    same = load_runner("tiny:3", num_slots=2, max_len=32)
    draft = load_runner("tiny:3", num_slots=2, max_len=32, agreement_noise=0.5)
    ids = list(range(1, 20))
    t, s, d = _logits(target, ids), _logits(same, ids), _logits(draft, ids)
    assert torch.equal(t, s)
    assert (t - d).abs().max() > 0.1
    assert target.num_slots == 2 and target.max_len == 32 and target.vocab_size == 256
    target.allocate()
    with pytest.raises(CacheFullError):
        target.allocate()
    with pytest.raises(ValueError, match="tiny:<integer seed>"):
        load_runner("tiny:x")


# --- the cache of what a GGUF load derives (pipeline.file_cache) -----------------------------

@pytest.mark.parametrize("arch, qtype", [("llama", Q.Q4_1), ("qwen2", Q.F32)])
def test_a_second_gguf_load_reads_the_cached_table_and_gets_the_same_weights(
        tmp_path, monkeypatch, arch, qtype):
    monkeypatch.setenv("SPECRELAY_CACHE_DIR", str(tmp_path / "cache"))
    hf = _hf_model(arch, seed=2)
    path = tmp_path / "m.gguf"
    _write_gguf(path, hf, arch, qtype)
    parsed = []
    real_reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda p: parsed.append(p) or real_reader(p))

    first = load_model(str(path), load_tokenizer=False)
    second = load_model(str(path), load_tokenizer=False)
    assert len(parsed) == 1  # the second load never parsed the file's metadata
    assert len(list((tmp_path / "cache" / "gguf-table").iterdir())) == 1
    assert second.config == first.config
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    runner = ModelRunner(second.model, second.config, 1, 64)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    assert (_logits(runner, IDS) - ref).abs().max() < 1e-4

    # a rewritten file (other weights, new mtime) misses the entry instead of reading it
    _write_gguf(path, _hf_model(arch, seed=3), arch, qtype)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    third = load_model(str(path), load_tokenizer=False)
    assert len(parsed) == 2
    assert not torch.equal(third.model.state_dict()["embed.weight"], a["embed.weight"])


def test_gguf_loads_without_a_usable_cache(tmp_path, monkeypatch, caplog):
    hf = _hf_model("llama", seed=2)
    path = tmp_path / "m.gguf"
    _write_gguf(path, hf, "llama", Q.Q8_0)
    want = load_model(str(path), load_tokenizer=False).model.state_dict()

    def same(loaded) -> bool:
        got = loaded.model.state_dict()
        return all(torch.equal(got[k], want[k]) for k in want)

    monkeypatch.setenv("SPECRELAY_CACHE_DIR", "off")
    assert same(load_model(str(path), load_tokenizer=False))
    # a folder that cannot be made (a file is in the way): loaded all the same, and said so
    blocker = tmp_path / "blocked"
    blocker.write_text("")
    monkeypatch.setenv("SPECRELAY_CACHE_DIR", str(blocker))
    with caplog.at_level("WARNING", logger="pipeline.file_cache"):
        assert same(load_model(str(path), load_tokenizer=False))
    assert "could not store" in caplog.text
    # a damaged entry is read past, not trusted
    monkeypatch.setenv("SPECRELAY_CACHE_DIR", str(tmp_path / "cache"))
    assert same(load_model(str(path), load_tokenizer=False))
    (table,) = (tmp_path / "cache" / "gguf-table").glob("*/table.json")
    table.write_text("{not json")
    assert same(load_model(str(path), load_tokenizer=False))
    assert not list((tmp_path / "cache" / "gguf-table").glob(".partial-*"))


def test_an_unsupported_gguf_is_never_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRELAY_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "bad.gguf"
    _write_gguf(path, _hf_model("llama"), "llama", bad_type=Q.IQ2_XXS)
    for _ in range(2):
        with pytest.raises(ValueError, match="unsupported quantization type IQ2_XXS"):
            load_model(str(path), load_tokenizer=False)
    assert not (tmp_path / "cache").exists()
