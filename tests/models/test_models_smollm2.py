"""The real SmolLM2-135M-Instruct (Q4_1 GGUF) through our loader and forward."""

from __future__ import annotations

import os

import pytest
import torch

from pipeline.models.loader import load_model
from pipeline.models.runner import ModelRunner

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model(smollm2_path, torch.float32, load_tokenizer=False, weights="float")


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path),
        dtype=torch.float32).eval()


def _chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def _greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Batched greedy decoding: one prefill forward, then one forward per step."""
    slots = [runner.allocate() for _ in prompts]
    logits = runner.forward(slots, prompts, last_only=True)
    out = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(steps - 1):
        logits = runner.forward(slots, [[o[-1]] for o in out])
        for o, lg in zip(out, logits):
            o.append(int(lg[-1].argmax()))
    for s in slots:
        runner.free(s)
    return out


def test_smollm2_config_from_gguf(smollm2):
    c = smollm2.config
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads,
            c.head_dim, c.intermediate_size) == (49152, 576, 30, 9, 3, 64, 1536)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.eos_token_ids == [2]


def test_smollm2_logits_match_hf(smollm2, hf_smollm2, smollm2_tokenizer):
    ids = _chat_ids(smollm2_tokenizer, QUESTION)
    runner = ModelRunner(smollm2.model, smollm2.config, 1, 256)
    ours = runner.forward([runner.allocate()], [ids])[0]
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape == (len(ids), 49152)
    assert (ours - ref).abs().max() < 1e-3


def test_smollm2_greedy_answers_paris_like_hf_generate(smollm2, hf_smollm2, smollm2_tokenizer):
    ids = _chat_ids(smollm2_tokenizer, QUESTION)
    runner = ModelRunner(smollm2.model, smollm2.config, 2, 256)
    ours = _greedy(runner, [ids], 12)[0]
    assert "Paris" in smollm2_tokenizer.decode(ours)
    with torch.no_grad():
        hf_out = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    hf_new = hf_out[0, len(ids):].tolist()  # generate stops at EOS (<|im_end|> = 2)
    assert len(hf_new) >= 6
    assert ours[:len(hf_new)] == hf_new


def test_smollm2_batched_greedy_equals_single(smollm2, smollm2_tokenizer):
    prompts = [_chat_ids(smollm2_tokenizer, q) for q in
               (QUESTION, "Name three colors.", "Write a haiku about the sea.")]
    runner = ModelRunner(smollm2.model, smollm2.config, 4, 256)
    batched = _greedy(runner, prompts, 10)
    for p, b in zip(prompts, batched):
        assert _greedy(runner, [p], 10)[0] == b


def test_the_cached_smollm2_tokenizer_is_the_converted_one(smollm2_path, smollm2_tokenizer,
                                                           tmp_path, monkeypatch):
    """The tokenizer read back from the cache (pipeline.file_cache) behaves exactly like the one
    transformers converts from the GGUF (conftest's, loaded without the cache)."""
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    from pipeline.tokenizer import eos_token_ids, load_tokenizer

    monkeypatch.setenv("SPECRELAY_CACHE_DIR", str(tmp_path))
    load_tokenizer(smollm2_path)  # converts and stores
    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint",
                        lambda *a, **k: pytest.fail("the GGUF was converted again"))
    cached = load_tokenizer(smollm2_path)
    ref = smollm2_tokenizer
    texts = ["What is the capital of France?", "  two spaces\n\ttab\r\n", "héllo 日本語 🙂 ½",
             "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2\n", ""]
    for text in texts:
        assert cached(text).input_ids == ref(text).input_ids
        assert cached(text, add_special_tokens=False).input_ids == \
            ref(text, add_special_tokens=False).input_ids
    ids = list(range(0, len(ref), 37)) + [2, 1, 0]
    assert cached.decode(ids) == ref.decode(ids)
    assert cached.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert cached.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for gen in (True, False):
        assert cached.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == \
            ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert len(cached) == len(ref) == 49152
    assert eos_token_ids(cached) == eos_token_ids(ref)
    assert cached.all_special_tokens == ref.all_special_tokens
    assert (cached.bos_token_id, cached.eos_token_id, cached.unk_token_id) == \
        (ref.bos_token_id, ref.eos_token_id, ref.unk_token_id)
