"""Model layer: logits equal HF transformers; KV cache rollback and batching invariances."""

from __future__ import annotations

import random

import pytest
import torch

from pipeline.models.config import ModelConfig
from pipeline.models.kv_cache import CacheFullError
from pipeline.models.llama import CpuLinear, _onednn_linear_available
from pipeline.models.loader import load_model
from pipeline.models.runner import ModelRunner
from pipeline.models.tiny import make_draft_target_pair, tiny_config, tiny_model

transformers = pytest.importorskip("transformers")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights (HF's 0.02 init gives near-uniform logits that hide errors)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _hf_roundtrip(tmp_path, hf_config, cls_name: str = "LlamaForCausalLM", seed: int = 0):
    torch.manual_seed(seed)
    hf = getattr(transformers, cls_name)(hf_config).eval()
    _randomize(hf, seed)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path))
    return hf, loaded


def _llama_hf_config(**kw):
    base = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
            "rope_theta": 10000.0, "tie_word_embeddings": False}
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _runner(loaded, num_slots: int = 4, max_len: int = 256) -> ModelRunner:
    return ModelRunner(loaded.model, loaded.config, num_slots=num_slots, max_len=max_len,
                       backend="sdpa")


def _ids(seed: int, n: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


PROMPT = _ids(7, 37)


def test_logits_match_hf_llama_loaded_from_safetensors(tmp_path):
    hf, loaded = _hf_roundtrip(tmp_path, _llama_hf_config())
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.tokenizer is None  # no tokenizer files in this folder
    runner = _runner(loaded)
    slot = runner.allocate()
    ours = runner.forward([slot], [PROMPT])[0]
    ref = _hf_logits(hf, PROMPT)
    assert ours.shape == (37, 300) and ours.dtype == torch.float32
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero tensors
    assert (ours - ref).abs().max() < 1e-4


def test_logits_match_hf_with_tied_embeddings_and_mha(tmp_path):
    hf, loaded = _hf_roundtrip(tmp_path, _llama_hf_config(tie_word_embeddings=True,
                                                          num_key_value_heads=4), seed=3)
    assert loaded.model.lm_head is None
    runner = _runner(loaded)
    ours = runner.forward([runner.allocate()], [PROMPT])[0]
    assert (ours - _hf_logits(hf, PROMPT)).abs().max() < 1e-4


def test_logits_match_hf_with_llama3_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf, loaded = _hf_roundtrip(tmp_path, _llama_hf_config(rope_scaling=scaling,
                                                          rope_theta=500000.0), seed=1)
    assert loaded.config.rope_scaling["rope_type"] == "llama3"
    assert loaded.config.rope_theta == 500000.0
    runner = _runner(loaded)
    ids = _ids(1, 120)  # past the original 16
    ours = runner.forward([runner.allocate()], [ids])[0]
    assert (ours - _hf_logits(hf, ids)).abs().max() < 1e-4


def test_logits_match_hf_qwen2_with_qkv_bias(tmp_path):
    cfg = transformers.Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=512, tie_word_embeddings=False)
    hf, loaded = _hf_roundtrip(tmp_path, cfg, "Qwen2ForCausalLM", seed=2)
    assert loaded.config.attention_bias is True
    assert loaded.model.layers[0].attn.wqkv.bias.abs().max() > 0
    runner = _runner(loaded)
    ours = runner.forward([runner.allocate()], [PROMPT])[0]
    assert (ours - _hf_logits(hf, PROMPT)).abs().max() < 1e-4


def test_decode_steps_match_hf_full_forward(tmp_path):
    hf, loaded = _hf_roundtrip(tmp_path, _llama_hf_config(), seed=4)
    runner = _runner(loaded)
    slot = runner.allocate()
    runner.forward([slot], [PROMPT[:30]])
    for i in range(30, 37):
        row = runner.forward([slot], [[PROMPT[i]]])[0]
        assert row.shape == (1, 300)
        assert (row[0] - _hf_logits(hf, PROMPT[: i + 1])[-1]).abs().max() < 1e-4
    assert runner.length(slot) == 37


# --- invariances of the slot cache --------------------------------------------------------

def _tiny_runner(num_slots: int = 4, max_len: int = 128, seed: int = 0, **cfg) -> ModelRunner:
    config = tiny_config(**cfg)
    return ModelRunner(tiny_model(config, seed), config, num_slots, max_len, backend="sdpa")


def _full_logits(committed: list[int], seed: int = 0) -> torch.Tensor:
    r = _tiny_runner(num_slots=1, seed=seed)
    return r.forward([r.allocate()], [committed])[0]


def test_verify_runs_with_rollback_equal_one_full_forward():
    rng = random.Random(11)
    runner = _tiny_runner()
    slot = runner.allocate()
    committed = [rng.randrange(256) for _ in range(20)]
    runner.forward([slot], [committed])
    k = 4
    for _ in range(8):
        run = [rng.randrange(256) for _ in range(k + 1)]
        logits = runner.forward([slot], [run])[0]
        ref = _full_logits(committed + run)[-(k + 1):]
        assert (logits - ref).abs().max() < 1e-5
        accepted = rng.randrange(1, k + 2)  # accepted drafts + the bonus token
        runner.truncate(slot, len(committed) + accepted)
        committed += run[:accepted]
        assert runner.length(slot) == len(committed)
    # After all rollbacks the cache holds exactly the committed prefix.
    nxt = [rng.randrange(256)]
    last = runner.forward([slot], [nxt])[0]
    assert (last - _full_logits(committed + nxt)[-1:]).abs().max() < 1e-5


def test_mixed_batch_equals_separate_forwards():
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (9, 3, 14, 6)]
    runs = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 17, 1)]
    batched = _tiny_runner()
    slots = [batched.allocate() for _ in prompts]
    batched.forward(slots, prompts)
    # Non-contiguous slot order exercises the gather path.
    order = [2, 0, 3, 1]
    out = batched.forward([slots[i] for i in order], [runs[i] for i in order])
    for j, i in enumerate(order):
        single = _tiny_runner(num_slots=1)
        s = single.allocate()
        single.forward([s], [prompts[i]])
        ref = single.forward([s], [runs[i]])[0]
        assert out[j].shape == (len(runs[i]), 256)
        assert (out[j] - ref).abs().max() < 1e-5
        assert batched.length(slots[i]) == len(prompts[i]) + len(runs[i])


def test_equal_length_batched_prefill_equals_single():
    rng = random.Random(13)
    prompts = [[rng.randrange(256) for _ in range(8)] for _ in range(3)]
    batched = _tiny_runner()
    out = batched.forward([batched.allocate() for _ in prompts], prompts)
    for o, p in zip(out, prompts):
        assert (o - _full_logits(p)).abs().max() < 1e-5


@pytest.mark.parametrize("use_slots", [[4, 0, 2], [0, 7, 3], [4, 2, 3], [3, 4, 2]])
def test_batches_over_slots_with_holes_equal_single(use_slots):
    """[4, 0, 2]: spread over 5 slots, attended as one slice with padding rows;
    [0, 7, 3]: spread over 8 > 2 * 3 slots, gathered; [4, 2, 3] and [3, 4, 2]: a contiguous
    range in another order (a freed slot reused), so runs must be scattered to their rows."""
    rng = random.Random(17)
    runner = _tiny_runner(num_slots=8)
    for _ in range(8):
        runner.allocate()
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (6, 2, 9)]
    runner.forward([1, 5, 6], [[1, 2, 3]] * 3)  # other slots hold unrelated tokens
    runner.forward(use_slots, prompts)
    for steps in ([[7], [8], [9]], [[7, 1, 2], [8], [9, 4]], [[3], [4], [5]]):
        out = runner.forward(use_slots, steps)
        for i, p in enumerate(prompts):
            p += steps[i]
            assert (out[i] - _full_logits(p)[-len(steps[i]):]).abs().max() < 1e-5


def test_uniform_decode_batch_with_different_lengths_equals_single():
    rng = random.Random(9)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (4, 11, 7)]
    batched = _tiny_runner()
    slots = [batched.allocate() for _ in prompts]
    batched.forward(slots, prompts)
    steps = [[rng.randrange(256)] for _ in prompts]
    out = batched.forward(slots, steps)
    for i, p in enumerate(prompts):
        assert (out[i] - _full_logits(p + steps[i])[-1:]).abs().max() < 1e-5


def test_last_only_returns_final_row_of_each_run():
    rng = random.Random(3)
    runs = [[rng.randrange(256) for _ in range(n)] for n in (5, 2, 3)]
    a, b, c = _tiny_runner(), _tiny_runner(), _tiny_runner()
    sa, sb, sc = ([r.allocate() for _ in runs] for r in (a, b, c))
    full = a.forward(sa, runs)
    last = b.forward(sb, runs, last_only=True)
    mixed = c.forward(sc, runs, last_only=[True, False, True])
    assert [m.shape[0] for m in mixed] == [1, 2, 1]
    for f, la, m in zip(full, last, mixed):
        assert la.shape == (1, 256)
        assert (f[-1:] - la).abs().max() < 1e-5
        assert (f[-m.shape[0]:] - m).abs().max() < 1e-5
    with pytest.raises(ValueError, match="2 last_only flags for 3 runs"):
        c.forward(sc, runs, last_only=[True, False])


def test_free_slot_is_reused_from_length_zero():
    runner = _tiny_runner(num_slots=2)
    s0 = runner.allocate()
    runner.forward([s0], [[5, 6, 7]])
    runner.free(s0)
    assert runner.num_free() == 2
    s = runner.allocate()
    assert s == 0 and runner.length(s) == 0
    out = runner.forward([s], [[9, 10]])[0]
    assert (out - _full_logits([9, 10])).abs().max() < 1e-5


def test_bfloat16_runner_tracks_float32():
    config = tiny_config()
    model = tiny_model(config, 0)
    ids = list(range(10, 40))
    r32 = ModelRunner(tiny_model(config, 0), config, 1, 64, dtype=torch.float32)
    r16 = ModelRunner(model, config, 1, 64, dtype=torch.bfloat16)
    a = r32.forward([r32.allocate()], [ids])[0]
    b = r16.forward([r16.allocate()], [ids])[0]
    assert b.dtype == torch.float32
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
    assert (a - b).abs().max() < 0.1 * a.abs().max()


# --- validation and errors ----------------------------------------------------------------

def test_cache_full_raises_clear_error():
    runner = _tiny_runner(num_slots=2)
    runner.allocate(), runner.allocate()
    assert runner.num_free() == 0
    with pytest.raises(CacheFullError, match="all 2 slots"):
        runner.allocate()


@pytest.mark.parametrize("slots, runs, message", [
    ([3], [[1]], "free"),
    ([9], [[1]], "unknown KV slot"),
    ([0], [[]], "empty run"),
    ([0], [[256]], "out of vocabulary"),
    ([0], [[-1]], "out of vocabulary"),
    ([0], [list(range(17))], "over max_len 16"),
    ([0, 0], [[1], [2]], "twice"),
    ([0], [[1], [2]], "1 slots but 2 runs"),
])
def test_forward_rejects_bad_arguments(slots, runs, message):
    runner = _tiny_runner(num_slots=4, max_len=16)
    runner.allocate()
    with pytest.raises(ValueError, match=message):
        runner.forward(slots, runs)
    assert runner.length(0) == 0  # nothing was committed


def test_truncate_cannot_grow():
    runner = _tiny_runner()
    s = runner.allocate()
    runner.forward([s], [[1, 2, 3]])
    with pytest.raises(ValueError, match="0..3"):
        runner.truncate(s, 4)
    runner.truncate(s, 1)
    assert runner.length(s) == 1


def test_config_rejects_unsupported_architecture():
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10})


def test_config_from_transformers4_style_llama31_dict():
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
         "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 131072, "bos_token_id": 128000,
         "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False,
         "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    c = ModelConfig.from_hf_dict(d)
    assert (c.head_dim, c.num_kv_heads, c.rope_theta) == (128, 8, 500000.0)
    assert c.rope_scaling["factor"] == 8.0 and c.eos_token_ids == [128001, 128008, 128009]
    assert c.attention_bias is False and c.eos_token_id == 128001
    with pytest.raises(ValueError, match="o_proj bias"):
        ModelConfig.from_hf_dict({**d, "attention_bias": True})
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        ModelConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_draft_target_pair_agreement_is_controlled():
    ids = _ids(0, 64, 256)

    def agreement(noise: float) -> float:
        pair = make_draft_target_pair(seed=0, agreement_noise=noise)
        t = ModelRunner(pair.target, pair.config, 1, 128)
        d = ModelRunner(pair.draft, pair.config, 1, 128)
        a = t.forward([t.allocate()], [ids])[0].argmax(-1)
        b = d.forward([d.allocate()], [ids])[0].argmax(-1)
        return (a == b).float().mean().item()

    assert agreement(0.0) == 1.0
    mid, high = agreement(0.1), agreement(1.0)
    assert 0.5 < mid < 1.0
    assert high < mid


@pytest.mark.skipif(not _onednn_linear_available(), reason="oneDNN linear is CPU-build only")
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_cpu_linear_equals_a_plain_linear_at_every_row_count(rows):
    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 96)
    fast = CpuLinear(plain)
    x = torch.randn(rows, 64)
    out = fast(x)  # 2 rows run padded to 3: the padding row must not come back
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-5)
