"""SmolLM2-135M (real GGUF weights): n-gram speculative decoding is token-for-token the same as
target-only greedy decoding, batch 1 and 8, with stop strings in the mix."""

from __future__ import annotations

import asyncio

import pytest
from support.reference_decode import greedy_reference

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine, collect
from pipeline.params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def engines():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: oversubscribing a shared CPU costs more than it gives
    none = build_local_engine(load_config("configs/smollm2-cpu.yaml", {
        "draft": "none", "num_slots": 8, "max_model_len": 256}))
    runner = none.stages.verifier.runner
    ngram = build_local_engine(load_config("configs/smollm2-cpu.yaml", {
        "num_slots": 8, "max_model_len": 256}), runner)
    yield none, ngram, runner
    torch.set_num_threads(threads)


def prompt(tokenizer, i: int) -> list[int]:
    text = f"Copy this code and rename `a` to `x{i}`:\n{CODE}"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_smollm2_ngram_equals_target_only_batch_1_and_8(engines):
    none, ngram, runner = engines
    tok = runner.tokenizer
    single = [("b1", prompt(tok, 0), SamplingParams(max_new_tokens=24))]
    ref = greedy_reference(runner, single[0][1], 24)
    batch = [(f"b8-{i}", prompt(tok, i), SamplingParams(
        max_new_tokens=6 + i, stop=["return"] if i % 3 == 1 else [], logprobs=1))
        for i in range(8)]
    for requests in (single, batch):
        spec = asyncio.run(collect(ngram, requests))
        plain = asyncio.run(collect(none, requests))
        for rid, *_ in requests:
            assert spec[rid].token_ids == plain[rid].token_ids
            assert spec[rid].text == plain[rid].text
            assert spec[rid].finish_reason == plain[rid].finish_reason
        if requests is single:
            got = spec["b1"].token_ids
            assert got == ref[: len(got)] and len(got) == 24  # a copy task: no early EOS
    assert ngram.stats.accepted_tokens > 0
    assert runner.num_free() == 8
