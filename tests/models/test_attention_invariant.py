"""The batch-invariant attention path (`attention_invariant`): a token's attention output and
logits are the same bits (`torch.equal`) whether it is computed as a decode, inside a verify
window, inside a prefill chunk of any size, or beside other requests of other lengths; on the
default path they are not (the same checks fail there, so they can fail)."""

from __future__ import annotations

import random

import pytest
import torch

from pipeline.config import EngineConfig
from pipeline.models.attention import attend, build_metadata, invariant_keys, invariant_rows
from pipeline.models.quant import quantize_linears
from pipeline.models.runner import ModelRunner
from pipeline.models.tiny import tiny_config, tiny_model

HEADS = [(9, 3), (4, 4), (8, 2), (6, 1), (12, 4)]  # (query heads, KV heads)
REQUESTS = 6


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _attention_mismatches(seed: int, invariant: bool) -> int:
    """One query row (a random request and position up to 1,200 keys) computed alone as a
    decode, then in 12 random forwards: a run of 1-100 tokens around it (verify window or
    prefill chunk) beside 0-4 other requests' runs. Returns how many of the 12 differ."""
    rng = random.Random(seed)
    h, kh = rng.choice(HEADS)
    d, bs = rng.choice([16, 64]), rng.choice([4, 16])
    max_len = 1300
    per_req = max_len // bs + 1
    gen = torch.Generator().manual_seed(seed)
    # stale values in every block: what lies past a run's keys must not matter
    k_cache = torch.randn(REQUESTS * per_req + 1, bs, kh, d, generator=gen)
    v_cache = torch.randn(REQUESTS * per_req + 1, bs, kh, d, generator=gen)
    blocks = list(range(1, REQUESTS * per_req + 1))
    rng.shuffle(blocks)
    tables = [blocks[i * per_req:(i + 1) * per_req] for i in range(REQUESTS)]
    queries = torch.randn(REQUESTS, max_len, h, d, generator=gen)
    group = h // kh if invariant else None

    def row(req: int, pos: int, runs: list[tuple[int, int, int]]) -> torch.Tensor:
        meta = build_metadata("sdpa", [tables[r] for r, _, _ in runs], [s for _, s, _ in runs],
                              [n for _, _, n in runs], bs, "cpu", group)
        q = torch.cat([queries[r, s:s + n] for r, s, n in runs])
        out = attend(q, k_cache, v_cache, meta, d ** -0.5)
        offset = 0
        for r, s, n in runs:
            if r == req:
                return out[offset + pos - s]
            offset += n
        raise AssertionError("the row's request is not in the forward")

    req, pos = rng.randrange(REQUESTS), rng.randint(0, 1200)
    decode = row(req, pos, [(req, pos, 1)])
    mismatches = 0
    for _ in range(12):
        width = rng.choice([1, 2, 3, 5, 8, 9, 16, 64, 100])
        runs = [(req, pos - rng.randrange(min(width, pos + 1)), width)]
        for other in rng.sample([r for r in range(REQUESTS) if r != req], rng.randint(0, 4)):
            runs.append((other, rng.randint(0, 1150), rng.choice([1, 1, 4, 5, 64])))
        rng.shuffle(runs)
        mismatches += not torch.equal(row(req, pos, runs), decode)
    return mismatches


@pytest.mark.parametrize("seed", range(8))
def test_a_rows_attention_is_the_same_bits_in_any_forward(seed, threads):
    assert _attention_mismatches(seed, invariant=True) == 0


def test_the_default_attention_is_not_batch_invariant(threads):
    assert sum(_attention_mismatches(seed, invariant=False) for seed in range(8)) > 0


def test_padding_keeps_every_query_block_and_the_last_key_block_in_a_safe_class():
    for n in range(1, 3000):
        keys = invariant_keys(n)
        assert keys >= n and keys % 16 == 0 and not 192 < keys % 512 < 384
        assert invariant_keys(keys) == keys  # a row's own padding is a fixed point
    for group in range(1, 13):
        for t in range(1, 400):
            rows = invariant_rows(t, group) * group
            split = 256 if rows >= 768 else 64 if rows >= 192 else 32
            assert rows >= max(4, t * group) and rows % split not in (1, 2, 3)


def _model(seed: int, quantized: bool):
    rng = random.Random(seed)
    h, kh = rng.choice(HEADS)
    d = 32 if h * 16 % 32 else rng.choice([16, 32])
    config = tiny_config(num_heads=h, num_kv_heads=kh, head_dim=d, num_layers=2,
                         tie_word_embeddings=rng.random() < 0.5)
    model = tiny_model(config, seed)
    if quantized:
        quantize_linears(model)
    return model, config


def _logit_mismatches(seed: int, setting: str, quantized: bool = True) -> tuple[int, int]:
    """Target request: a prompt then 12 tokens. Reference: the prompt in one run, the tokens
    decoded one a forward, alone. Then the same request again, its prompt in chunks of 7, 16 or
    64 and its tokens in verify windows of 1-8, beside other requests prefilling and decoding.
    Returns (positions that differ, positions compared)."""
    rng = random.Random(seed)
    model, config = _model(seed, quantized)
    runner = ModelRunner(model, config, num_slots=5, max_len=700, attention_invariant=setting)
    assert runner.invariant == (setting == "on")
    prompt = [rng.randrange(3, config.vocab_size) for _ in range(rng.randint(20, 560))]
    tokens = [rng.randrange(3, config.vocab_size) for _ in range(12)]
    ref = runner.allocate()
    want = [runner.forward([ref], [prompt], last_only=True)[0][-1]]
    want += [runner.forward([ref], [[t]])[0][-1] for t in tokens]
    runner.free(ref)

    target = runner.allocate()
    others = [runner.allocate() for _ in range(3)]
    text = {s: [rng.randrange(3, config.vocab_size) for _ in range(600)] for s in others}
    fed = dict.fromkeys(others, 0)

    def step(runs_target: list[int]) -> torch.Tensor:
        busy = [s for s in others if rng.random() < 0.7 and fed[s] < 560]
        runs = {s: text[s][fed[s]:fed[s] + rng.choice([1, 1, 5, 23])] for s in busy}
        slots = [target, *busy]
        rng.shuffle(slots)
        out = runner.forward(slots, [runs_target if s == target else runs[s] for s in slots])
        for s in busy:
            fed[s] += len(runs[s])
        return out[slots.index(target)]

    chunk = rng.choice([7, 16, 64])
    for i in range(0, len(prompt), chunk):
        last = step(prompt[i:i + chunk])[-1]
    got = [last]
    i = 0
    while i < len(tokens):
        window = tokens[i:i + rng.randint(1, 8)]
        got += list(step(window))
        i += len(window)
    return sum(not torch.equal(a, b) for a, b in zip(got, want)), len(want)


@pytest.mark.parametrize("seed", range(6))
def test_a_tokens_logits_are_the_same_bits_in_any_forward(seed):
    assert _logit_mismatches(seed, "on") == (0, 13)


@pytest.mark.parametrize("seed", range(2))
def test_float_weights_are_batch_invariant_too_when_asked(seed):
    assert _logit_mismatches(seed, "on", quantized=False) == (0, 13)


def test_the_default_path_gives_other_logits_in_other_forwards():
    assert sum(_logit_mismatches(seed, "off")[0] for seed in range(6)) > 0


def test_auto_is_on_exactly_for_4bit_projections_on_the_cpu_in_float32():
    float_model, config = _model(0, quantized=False)
    assert not ModelRunner(float_model, config, num_slots=1, max_len=32).invariant
    quant_model, config = _model(0, quantized=True)
    assert ModelRunner(quant_model, config, num_slots=1, max_len=32).invariant
    quant_model, config = _model(0, quantized=True)
    assert not ModelRunner(quant_model, config, num_slots=1, max_len=32,
                           attention_invariant="off").invariant


def test_on_is_refused_where_it_is_not_made_invariant():
    model, config = _model(0, quantized=False)
    with pytest.raises(ValueError, match="float32"):
        ModelRunner(model, config, num_slots=1, max_len=32, dtype=torch.bfloat16,
                    attention_invariant="on")
    with pytest.raises(ValueError, match="attention_invariant"):
        EngineConfig(model="tiny:0", attention_invariant="on", dtype="bfloat16")
    with pytest.raises(ValueError, match="attention_invariant"):
        EngineConfig(model="tiny:0", attention_invariant="yes")
