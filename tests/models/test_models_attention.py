"""Attention backends. The flash path runs through the real vllm-flash-attn 2.6.2 Python wrapper
(fetched from PyPI, loaded unchanged) over a pure-torch stand-in for its CUDA extension
(`tests/support/flash_wheel.py`), so a wrong keyword, argument order, dtype or layout fails here on CPU."""

from __future__ import annotations

import random
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from support import flash_wheel

import pipeline.models.runner as runner_mod
from pipeline.models import attention
from pipeline.models.attention import attend, build_metadata, resolve_backend, write_kv
from pipeline.models.runner import ModelRunner
from pipeline.models.tiny import tiny_config, tiny_model


@pytest.fixture
def flash_ext(monkeypatch):
    ext = flash_wheel.install(monkeypatch)
    monkeypatch.setattr(runner_mod, "resolve_backend", lambda backend, device, dtype: backend)
    return ext


def _mixed_batch(backend: str, capacity: int):
    """Slots in shuffled order: a prefill, a decode, a verify run and a decode that fills its
    slot to capacity."""
    slots, starts, q_lens = [4, 1, 3, 0], [0, 20, 11, capacity - 1], [9, 1, 5, 1]
    return build_metadata(backend, _one_block_each(slots), starts, q_lens, capacity,
                          "cpu"), sum(q_lens)


def _one_block_each(slots):
    """Block tables of one block per sequence (block size = its capacity)."""
    return [[s] for s in slots]


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_flash_wrapper_matches_sdpa_on_a_mixed_prefill_decode_verify_batch(flash_ext, heads):
    h, kh = heads
    d, capacity, scale = 16, 32, 0.25
    gen = torch.Generator().manual_seed(0)
    # Stale values everywhere: anything past a slot's length must be ignored by both paths.
    k_cache = torch.randn(6, capacity, kh, d, generator=gen).bfloat16()
    v_cache = torch.randn(6, capacity, kh, d, generator=gen).bfloat16()
    meta_f, n = _mixed_batch("flash", capacity)
    meta_s, _ = _mixed_batch("sdpa", capacity)
    q = torch.randn(n, h, d, generator=gen).bfloat16()
    k_new = torch.randn(n, kh, d, generator=gen).bfloat16()
    v_new = torch.randn(n, kh, d, generator=gen).bfloat16()
    write_kv(k_cache, v_cache, k_new, v_new, meta_f)
    got = attend(q, k_cache, v_cache, meta_f, scale)
    ref = attend(q.float(), k_cache.float(), v_cache.float(), meta_s, scale)
    assert flash_ext.calls == 1
    assert got.shape == (n, h * d) and got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() < 2e-2


def test_flash_runner_matches_sdpa_through_prefill_verify_rollback_and_slot_reuse(flash_ext):
    config = tiny_config()
    flash = ModelRunner(tiny_model(config, 1), config, 5, 40, dtype=torch.bfloat16,
                        backend="flash")
    sdpa = ModelRunner(tiny_model(config, 1), config, 5, 40, backend="sdpa")
    assert flash.cache.block_size == sdpa.cache.block_size == 16
    assert flash.cache.num_blocks == 5 * 3  # the default pool: one max_len row per slot
    rng = random.Random(2)
    for r in (flash, sdpa):
        for _ in range(5):
            r.allocate()
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (7, 12, 3, 20)]
    steps = [
        ([3, 0, 4, 2], prompts),                                 # prefills, shuffled slots
        ([2, 0, 4], [[5, 6, 7, 8, 9], [4], [1, 2]]),             # verify, decode, verify
        ("rollback", None),                                      # reject drafts; slot 3 freed
        ([1, 4, 0, 3], [[1, 2, 3], [2], [3, 4, 5, 6, 7], [9]]),  # reused slots 1 and 3 prefill
        ([3, 2, 1, 0, 4], [[8], [7], [6], [5], [4]]),            # all decode
    ]
    for slots, runs in steps:
        if slots == "rollback":
            for r in (flash, sdpa):
                r.truncate(2, 20 + 2)
                r.truncate(4, 3 + 1)
                r.free(3), r.free(1)
                assert r.allocate() == 1 and r.allocate() == 3
            continue
        got = flash.forward(slots, runs)
        ref = sdpa.forward(slots, runs)
        for g, r in zip(got, ref):
            # bf16 weights and activations against an fp32 SDPA model: same greedy tokens,
            # logits within bf16 noise (|logits| is about 10 here).
            assert torch.equal(g.argmax(-1), r.argmax(-1))
            assert (g - r).abs().max() < 0.3
    assert flash_ext.calls == config.num_layers * (len(steps) - 1)  # flash ran: each layer, each forward


def _paged_batch(backend: str):
    """Runs over multi-block tables of 16-token blocks: a decode and a verify run that share
    their first block (a common prefix), a prefill into blocks out of order, and a decode whose
    blocks were someone else's (stale values past its keys)."""
    tables = [[5, 2, 9], [5, 7], [8, 1, 3, 0], [4, 6]]
    starts, q_lens = [40, 20, 0, 17], [1, 5, 50, 1]
    return build_metadata(backend, tables, starts, q_lens, 16, "cpu"), sum(q_lens)


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_flash_wrapper_matches_sdpa_on_multi_block_tables(flash_ext, heads):
    h, kh = heads
    d, scale = 16, 0.25
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(10, 16, kh, d, generator=gen).bfloat16()  # stale everywhere
    v_cache = torch.randn(10, 16, kh, d, generator=gen).bfloat16()
    meta_f, n = _paged_batch("flash")
    meta_s, _ = _paged_batch("sdpa")
    assert meta_f.block_table.shape == (4, 4)
    q = torch.randn(n, h, d, generator=gen).bfloat16()
    write_kv(k_cache, v_cache, torch.randn(n, kh, d, generator=gen).bfloat16(),
             torch.randn(n, kh, d, generator=gen).bfloat16(), meta_f)
    got = attend(q, k_cache, v_cache, meta_f, scale)
    ref = attend(q.float(), k_cache.float(), v_cache.float(), meta_s, scale)
    assert flash_ext.calls == 1
    assert (got.float() - ref).abs().max() < 2e-2


def test_flash_wrapper_refuses_a_one_page_per_sequence_block_table(flash_ext):
    """The slot cache's form (`block_table = slots[:, None]`, one page per sequence) cannot
    address a sequence spread over several blocks: the kernel contract catches it."""
    meta, n = _paged_batch("flash")
    meta.block_table = meta.block_table[:, :1].contiguous()
    cache = torch.zeros(10, 16, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="more keys than its pages hold"):
        attend(torch.zeros(n, 4, 16, dtype=torch.bfloat16), cache, cache, meta, 0.25)


def test_flash_runner_reuses_evicted_blocks_and_matches_a_fresh_run(flash_ext):
    """A pool of 6 blocks for 2 sequences: freed blocks (stale KV) are reused at once, tables
    come out of order, and every forward matches SDPA and a fresh runner's logits."""
    config = tiny_config()
    rng = random.Random(4)

    def runner(backend, dtype=torch.bfloat16, tokens=96):
        return ModelRunner(tiny_model(config, 1), config, 2, 64, dtype=dtype, backend=backend,
                           kv_cache_tokens=tokens)

    flash, sdpa = runner("flash"), runner("sdpa", torch.float32)
    a, b, c = ([rng.randrange(256) for _ in range(n)] for n in (33, 20, 47))
    for r in (flash, sdpa):
        assert r.allocate() == 0 and r.allocate() == 1
    got, ref = flash.forward([0, 1], [a, b]), sdpa.forward([0, 1], [a, b])
    assert flash.cache.table(0) == [0, 1, 2] and flash.cache.table(1) == [3, 4]
    for r in (flash, sdpa):
        r.free(0)          # blocks 0, 1, 2 go back ahead of block 5 (stale KV)
        r.truncate(1, 16)  # block 4 goes back too, ahead of them
        assert r.allocate() == 0
    got += flash.forward([0, 1], [c, b[16:17]])
    ref += sdpa.forward([0, 1], [c, b[16:17]])
    assert flash.cache.table(0) == [4, 0, 1] and flash.cache.table(1) == [3, 2]
    got += flash.forward([0], [[7, 8]])   # crosses into a fourth block: the never-used 5
    ref += sdpa.forward([0], [[7, 8]])
    assert flash.cache.table(0) == [4, 0, 1, 5]
    with pytest.raises(runner_mod.CacheFullError):
        flash.forward([0, 1], [[1] * 9, [2] * 30])  # 3 more blocks needed, 0 free
    assert flash.cache.blocks.num_free == 0 and flash.length(1) == 17  # nothing applied
    fresh = runner("flash", tokens=64)
    fresh.allocate()
    want = fresh.forward([0], [c + [7, 8]])[0]
    for g, r in zip(got, ref):
        assert torch.equal(g.argmax(-1), r.argmax(-1)) and (g - r).abs().max() < 0.3
    assert torch.equal(got[2].argmax(-1), want[:47].argmax(-1))
    assert torch.equal(got[4].argmax(-1), want[47:].argmax(-1))
    flash.cache.blocks.check()


def test_flash_runner_shares_cached_prefix_blocks_between_live_sequences(flash_ext):
    """Prefix caching: two live sequences read the same cached blocks of a third's committed
    prompt (block_table rows with equal leading ids), and a sequence after its owner left
    reuses them from the cache; the logits match a fresh, uncached run of each whole prompt."""
    config = tiny_config()
    rng = random.Random(6)

    def runner(caching):
        return ModelRunner(tiny_model(config, 1), config, 4, 96, dtype=torch.bfloat16,
                           backend="flash", prefix_caching=caching)

    cached = runner(True)
    system = [rng.randrange(256) for _ in range(40)]
    prompts = [system + [rng.randrange(256) for _ in range(n)] for n in (5, 9, 20)]
    a = cached.allocate()
    cached.forward([a], [prompts[0]])
    cached.truncate(a, len(prompts[0]))       # committed: blocks 0 and 1 (32 tokens) keyed
    got = {}
    b, c = cached.allocate(), cached.allocate()
    assert cached.attach_prefix(b, prompts[1]) == cached.attach_prefix(c, prompts[2]) == 32
    assert cached.cache.table(b) == cached.cache.table(c) == cached.cache.table(a)[:2]
    got[1], got[2] = cached.forward([b, c], [prompts[1][32:], prompts[2][32:]])
    assert cached.cache.table(b)[:2] == cached.cache.table(c)[:2]
    assert cached.cache.table(b)[2] != cached.cache.table(c)[2]
    for slot in (a, b, c):
        cached.free(slot)
    d = cached.allocate()                      # everyone left: the blocks wait in the cache
    assert cached.attach_prefix(d, prompts[0]) == 32
    got[0] = cached.forward([d], [prompts[0][32:]])[0]
    cached.cache.blocks.check()
    for i, prompt in enumerate(prompts):
        fresh = runner(False)
        want = fresh.forward([fresh.allocate()], [prompt])[0][32:]
        assert torch.equal(got[i].argmax(-1), want.argmax(-1)) and (got[i] - want).abs().max() < 0.3


def test_flash_wrapper_rejects_the_removed_seqused_k_keyword(flash_ext):
    from vllm_flash_attn import flash_attn_varlen_func

    meta, n = _mixed_batch("flash", 32)
    cache = torch.zeros(6, 32, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="seqused_k"):
        flash_attn_varlen_func(torch.zeros(n, 4, 16, dtype=torch.bfloat16), cache, cache,
                               cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_q,
                               max_seqlen_k=meta.max_k, seqused_k=meta.cu_seqlens_k[1:])


def test_flash_metadata_layout():
    # Run 0 holds 30 keys then appends 5 (positions 30..34: blocks 7, 2, 5); run 1 is a 2-token
    # prefill in block 1. Tables are padded with block 0 to the widest run.
    meta = build_metadata("flash", [[7, 2, 5], [1]], [30, 0], [5, 2], block_size=16,
                          device="cpu")
    assert meta.cu_seqlens_q.tolist() == [0, 5, 7]
    assert meta.cu_seqlens_k.tolist() == [0, 35, 37]
    assert meta.cu_seqlens_q.dtype == meta.cu_seqlens_k.dtype == torch.int32
    assert meta.block_table.tolist() == [[7, 2, 5], [1, 0, 0]]
    assert meta.block_table.dtype == torch.int32
    assert meta.write_idx.tolist() == [2 * 16 + 14, 2 * 16 + 15, 5 * 16, 5 * 16 + 1,
                                       5 * 16 + 2, 16, 17]
    assert (meta.max_q, meta.max_k) == (5, 35)


def test_a_block_table_too_short_for_its_keys_is_refused():
    with pytest.raises(ValueError, match="cannot hold 17 keys"):
        build_metadata("sdpa", [[3]], [16], [1], block_size=16, device="cpu")


def test_sdpa_gqa_without_enable_gqa_repeats_kv_heads(monkeypatch):
    """torch 2.4 has no `enable_gqa`: the prefill path must not pass it and still match."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 2, 8, 2, 8, generator=gen)
    q = torch.randn(7, 6, 8, generator=gen)
    meta = build_metadata("sdpa", [[1], [0]], [2, 0], [3, 4], block_size=8, device="cpu")
    want = attend(q, k_cache, v_cache, meta, 0.3)
    real = F.scaled_dot_product_attention

    def sdpa_2_4(*args, **kwargs):
        assert "enable_gqa" not in kwargs, "torch 2.4's SDPA has no enable_gqa"
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "SDPA_HAS_GQA", False)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa_2_4)
    got = attend(q, k_cache, v_cache, meta, 0.3)
    assert torch.allclose(got, want, atol=1e-6)


def test_sdpa_mask_is_causal_within_run_and_hides_stale_keys():
    meta = build_metadata("sdpa", [[0], [1]], [2, 0], [2, 1], block_size=8, device="cpu")
    # Run 0 holds 2 tokens and appends 2 (positions 2, 3); run 1 appends 1 at position 0.
    assert meta.mask[:, 0].int().tolist() == [
        [[1, 1, 1, 0], [1, 1, 1, 1]],
        [[1, 0, 0, 0], [1, 0, 0, 0]],   # padded row of slot 1 still sees a key (no NaN)
    ]
    assert meta.pad_idx.tolist() == [0, 1, 2]


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [4, 1, 2], [20, 1, 3], [18, 20, 17]])
def test_sdpa_reads_keys_through_multi_block_tables(q_lens):
    """Runs whose keys span several blocks, in any order, one block shared by two runs (a
    common prefix): the same attention as over each run's keys laid out contiguously."""
    gen = torch.Generator().manual_seed(sum(q_lens))
    h, kh, d, bs, scale = 6, 2, 8, 4, 0.3
    tables = [[6, 0, 9, 3, 11, 1, 12], [6, 2, 8, 5, 10, 13], [7, 4, 14, 15, 16, 17]]
    starts = [5, 4, 3]  # runs 0 and 1 share block 6 (a common 4-token prefix)
    k_cache = torch.randn(18, bs, kh, d, generator=gen)
    v_cache = torch.randn(18, bs, kh, d, generator=gen)
    n = sum(q_lens)
    q = torch.randn(n, h, d, generator=gen)
    meta = build_metadata("sdpa", tables, starts, q_lens, bs, "cpu")
    write_kv(k_cache, v_cache, torch.randn(n, kh, d, generator=gen),
             torch.randn(n, kh, d, generator=gen), meta)
    got = attend(q, k_cache, v_cache, meta, scale)
    # the same keys laid out one row per run: block tables -> contiguous "slots"
    rows_k = torch.stack([torch.cat([k_cache[b] for b in t] + [k_cache[0]] * (7 - len(t)))
                          for t in tables])
    rows_v = torch.stack([torch.cat([v_cache[b] for b in t] + [v_cache[0]] * (7 - len(t)))
                          for t in tables])
    want = _naive_attention(q, rows_k, rows_v, [0, 1, 2], starts, q_lens, scale)
    assert torch.allclose(got, want, atol=1e-5)


def test_backend_switch():
    assert resolve_backend("auto", "cpu", torch.float32) == "sdpa"
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "sdpa"
    assert resolve_backend("sdpa", "cpu", torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("flash", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("xformers", "cpu", torch.float32)


def test_auto_picks_flash_only_on_cuda_when_the_import_works(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention, "flash_import_error", lambda: "OSError: undefined symbol")
    assert resolve_backend("auto", "cuda", torch.bfloat16) == "sdpa"
    with pytest.raises(ValueError, match="vllm-flash-attn.*undefined symbol"):
        resolve_backend("flash", "cuda", torch.bfloat16)
    monkeypatch.setattr(attention, "flash_import_error", lambda: None)
    assert resolve_backend("auto", "cuda", torch.bfloat16) == "flash"
    assert resolve_backend("auto", "cuda", torch.float32) == "sdpa"
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "sdpa"


def test_flash_import_error_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", None)  # import fails
    attention.flash_import_error.cache_clear()
    try:
        assert attention.flash_import_error().startswith("ModuleNotFoundError: ")
    finally:
        attention.flash_import_error.cache_clear()


def _naive_attention(q, k_cache, v_cache, slots, starts, q_lens, scale):
    """Per new token, softmax over its slot's keys up to its own position (GQA: query head j
    reads KV head j // group)."""
    h, kh = q.shape[1], k_cache.shape[2]
    out, n = [], 0
    for slot, start, length in zip(slots, starts, q_lens):
        for t in range(length):
            keys = k_cache[slot, : start + t + 1]    # [L, KH, D]
            vals = v_cache[slot, : start + t + 1]
            heads = []
            for j in range(h):
                w = torch.softmax(keys[:, j // (h // kh)] @ q[n, j] * scale, dim=0)
                heads.append(w @ vals[:, j // (h // kh)])
            out.append(torch.cat(heads))
            n += 1
    return torch.stack(out)


@pytest.mark.parametrize(("q_lens", "queries"), [
    ([1, 1, 1], [(3, 2, 3, 8)]),                      # decodes: [B, KH, G, D]
    ([3, 1, 2], [(3, 2, 9, 8)]),                      # verify: [B, KH, T*G, D]
    ([3, 2, 1], [(3, 2, 9, 8)]),                      # splitting would save 3 rows: one call
    ([1, 5, 1], [(2, 2, 3, 8), (1, 2, 15, 8)]),       # a long draft: decodes apart, unpadded
    ([1, 9, 2], [(2, 2, 6, 8), (1, 2, 27, 8)]),
    ([18, 1, 2], [(2, 2, 6, 8), (1, 6, 18, 8)]),      # a prompt: its own call, [B, H, T, D]
    ([18, 20, 1], [(1, 2, 3, 8), (2, 6, 20, 8)]),     # the two prompts gathered: two rows
    ([18, 20, 17], [(3, 6, 20, 8)]),                  # prompts only: one call
])
def test_sdpa_runs_fold_gqa_and_match_per_token_attention(q_lens, queries, monkeypatch):
    """Decode and verify windows put the GQA group and the run's tokens on one query axis (K/V
    read once per KV head, never repeated); prompts (over FOLD_MAX_T) keep [B, H, T, D] and,
    next to decodes, get an SDPA call of their own. Every layout matches attention computed
    token by token."""
    gen = torch.Generator().manual_seed(5)
    h, kh, d, capacity, scale = 6, 2, 8, 48, 0.3
    slots, starts = [2, 0, 1], [4, 9, 0]
    k_cache = torch.randn(3, capacity, kh, d, generator=gen)
    v_cache = torch.randn(3, capacity, kh, d, generator=gen)
    meta = build_metadata("sdpa", _one_block_each(slots), starts, q_lens, capacity, "cpu")
    n = sum(q_lens)
    q = torch.randn(n, h, d, generator=gen)
    k_new = torch.randn(n, kh, d, generator=gen)
    v_new = torch.randn(n, kh, d, generator=gen)
    write_kv(k_cache, v_cache, k_new, v_new, meta)
    shapes, real = [], F.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        shapes.append(tuple(query.shape))
        return real(query, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    got = attend(q, k_cache, v_cache, meta, scale)
    want = _naive_attention(q, k_cache, v_cache, slots, starts, q_lens, scale)
    assert torch.allclose(got, want, atol=1e-5)
    assert shapes == queries


@given(st.lists(st.integers(1, 20), min_size=1, max_size=12))
def test_split_runs_partitions_the_runs_and_only_saves_padding(q_lens):
    """Groups cover every run once, in order inside a group; a split keeps prompts apart from
    decode/verify runs, and otherwise pads at least SPLIT_MIN_ROWS rows (and half) less."""
    parts = attention.split_runs(q_lens)
    if parts is None:
        return
    assert len(parts) == 2 and all(parts) and all(p == sorted(p) for p in parts)
    assert sorted(parts[0] + parts[1]) == list(range(len(q_lens)))
    long = [q > attention.FOLD_MAX_T for q in q_lens]
    if any(long):
        assert [long[i] for i in parts[1]] == [True] * len(parts[1]) and not any(
            long[i] for i in parts[0])
        return
    padded = len(q_lens) * max(q_lens)
    split = sum(len(p) * max(q_lens[i] for i in p) for p in parts)
    assert padded - split >= max(attention.SPLIT_MIN_ROWS, padded / 2)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=5, max_size=5), st.permutations(range(6)))
def test_ragged_verify_batches_match_per_token_attention(q_lens, order):
    """Decode and verify runs of any lengths, in any slots, split or not: the same attention."""
    gen = torch.Generator().manual_seed(sum(q_lens))
    h, kh, d, capacity, scale = 6, 2, 8, 32, 0.3
    slots, starts = list(order[:5]), [3, 0, 7, 12, 1]
    k_cache = torch.randn(6, capacity, kh, d, generator=gen)
    v_cache = torch.randn(6, capacity, kh, d, generator=gen)
    meta = build_metadata("sdpa", _one_block_each(slots), starts, q_lens, capacity, "cpu")
    n = sum(q_lens)
    q = torch.randn(n, h, d, generator=gen)
    write_kv(k_cache, v_cache, torch.randn(n, kh, d, generator=gen),
             torch.randn(n, kh, d, generator=gen), meta)
    got = attend(q, k_cache, v_cache, meta, scale)
    want = _naive_attention(q, k_cache, v_cache, slots, starts, q_lens, scale)
    assert torch.allclose(got, want, atol=1e-5)
