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
from gguf import GGMLQuantizationType as Q
from support.gguf_models import hf_model, write_gguf

from pipeline.models import CacheFullError, load_runner
from pipeline.models.loader import load_model
from pipeline.models.runner import ModelRunner

_RNG = random.Random(4)
IDS = [_RNG.randrange(320) for _ in range(41)]


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    return runner.forward([runner.allocate()], [ids])[0]


@pytest.mark.parametrize("arch, qtype", [("llama", Q.F32), ("llama", Q.Q8_0), ("qwen2", Q.F32),
                                         ("llama", Q.Q4_1)])
def test_gguf_logits_match_hf(tmp_path, arch, qtype):
    hf = hf_model(arch)
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, arch, qtype)
    loaded = load_model(str(path), load_tokenizer=False, weights="float")
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
    hf = hf_model("llama")
    path = tmp_path / "bad.gguf"
    write_gguf(path, hf, "llama", bad_type=Q.IQ2_XXS)
    with pytest.raises(ValueError, match="unsupported quantization type IQ2_XXS"):
        load_model(str(path), load_tokenizer=False)


def test_gguf_rope_freqs_scaling_is_rejected(tmp_path):
    path = tmp_path / "llama31.gguf"
    write_gguf(path, hf_model("llama"), "llama",
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
    (tmp_path / "config.json").write_text(json.dumps(hf_model("llama").config.to_dict()))
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
    hf = hf_model("llama", seed=5)
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
    hf = hf_model(arch, seed=2)
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, arch, qtype)
    parsed = []
    real_reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda p: parsed.append(p) or real_reader(p))

    first = load_model(str(path), load_tokenizer=False, weights="float")
    second = load_model(str(path), load_tokenizer=False, weights="float")
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
    write_gguf(path, hf_model(arch, seed=3), arch, qtype)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    third = load_model(str(path), load_tokenizer=False, weights="float")
    assert len(parsed) == 2
    assert not torch.equal(third.model.state_dict()["embed.weight"], a["embed.weight"])


def test_gguf_loads_without_a_usable_cache(tmp_path, monkeypatch, caplog):
    hf = hf_model("llama", seed=2)
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama", Q.Q8_0)
    want = load_model(str(path), load_tokenizer=False, weights="float").model.state_dict()

    def same(loaded) -> bool:
        got = loaded.model.state_dict()
        assert got.keys() == want.keys()
        return all(torch.equal(got[k], want[k]) for k in want)

    monkeypatch.setenv("SPECRELAY_CACHE_DIR", "off")
    assert same(load_model(str(path), load_tokenizer=False, weights="float"))
    # a folder that cannot be made (a file is in the way): loaded all the same, and said so
    blocker = tmp_path / "blocked"
    blocker.write_text("")
    monkeypatch.setenv("SPECRELAY_CACHE_DIR", str(blocker))
    with caplog.at_level("WARNING", logger="pipeline.file_cache"):
        assert same(load_model(str(path), load_tokenizer=False, weights="float"))
    assert "could not store" in caplog.text
    # a damaged entry is read past, not trusted
    monkeypatch.setenv("SPECRELAY_CACHE_DIR", str(tmp_path / "cache"))
    assert same(load_model(str(path), load_tokenizer=False, weights="float"))
    (table,) = (tmp_path / "cache" / "gguf-table").glob("*/table.json")
    table.write_text("{not json")
    assert same(load_model(str(path), load_tokenizer=False, weights="float"))
    assert not list((tmp_path / "cache" / "gguf-table").glob(".partial-*"))


def test_an_unsupported_gguf_is_never_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRELAY_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "bad.gguf"
    write_gguf(path, hf_model("llama"), "llama", bad_type=Q.IQ2_XXS)
    for _ in range(2):
        with pytest.raises(ValueError, match="unsupported quantization type IQ2_XXS"):
            load_model(str(path), load_tokenizer=False)
    assert not (tmp_path / "cache").exists()
