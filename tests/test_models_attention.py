"""Attention backend switch, and the flash path's call into vllm-flash-attn checked on CPU
against a pure-torch stand-in that implements the documented `flash_attn_varlen_func`
contract (paged KV via block_table + seqused_k, bottom-right causal, GQA)."""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch

import pipeline.models.runner as runner_mod
from pipeline.models.attention import build_metadata, resolve_backend
from pipeline.models.runner import ModelRunner
from pipeline.models.tiny import tiny_config, tiny_model


def fake_flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k,
                                cu_seqlens_k=None, seqused_k=None, q_v=None, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=None,
                                softcap=0.0, alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, block_table=None,
                                return_softmax_lse=False, out=None, **_fa3):
    assert cu_seqlens_q.dtype == torch.int32 and seqused_k.dtype == torch.int32
    assert block_table.dtype == torch.int32 and cu_seqlens_k is None
    assert k.shape[1] % 16 == 0, "paged KV block size must be a multiple of 16"
    assert q.stride(-1) == 1 and causal
    h, kh = q.shape[1], k.shape[2]
    res = torch.empty_like(q)
    for i in range(len(seqused_k)):
        a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        n_k = int(seqused_k[i])
        assert b - a <= max_seqlen_q and n_k <= max_seqlen_k
        keys = torch.cat([k[blk] for blk in block_table[i].tolist()])[:n_k]
        vals = torch.cat([v[blk] for blk in block_table[i].tolist()])[:n_k]
        keys = keys.repeat_interleave(h // kh, dim=1)   # GQA: q head j uses kv head j // g
        vals = vals.repeat_interleave(h // kh, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), keys.float()) * softmax_scale
        qpos = torch.arange(b - a)[:, None] + (n_k - (b - a))   # bottom-right alignment
        scores = scores.masked_fill(torch.arange(n_k)[None, :] > qpos, float("-inf"))
        res[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals.float()).to(q.dtype)
    return res


@pytest.fixture
def fake_flash(monkeypatch):
    mod = types.ModuleType("vllm_flash_attn")
    mod.flash_attn_varlen_func = fake_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", mod)
    monkeypatch.setattr(runner_mod, "resolve_backend", lambda backend, device, dtype: backend)


def test_flash_path_matches_sdpa_through_prefill_verify_rollback(fake_flash):
    config = tiny_config()
    flash = ModelRunner(tiny_model(config, 1), config, 4, 40, backend="flash")
    sdpa = ModelRunner(tiny_model(config, 1), config, 4, 40, backend="sdpa")
    assert flash.cache.capacity == 48 and sdpa.cache.capacity == 40
    rng = random.Random(2)
    for r in (flash, sdpa):
        r.allocate(), r.allocate(), r.allocate()
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (7, 12, 3)]
    steps = [([0, 1, 2], prompts), ([2, 0], [[5, 6, 7, 8, 9], [4]]),
             ([1, 2, 0], [[1], [2], [3, 4, 5, 6, 7]])]
    for i, (slots, runs) in enumerate(steps):
        got = flash.forward(slots, runs)
        ref = sdpa.forward(slots, runs)
        for g, r in zip(got, ref):
            assert (g - r).abs().max() < 1e-4
        if i == 1:
            for r in (flash, sdpa):
                r.truncate(2, 3 + 2)


def test_flash_metadata_layout():
    meta = build_metadata("flash", [3, 1], [10, 0], [5, 2], capacity=32, device="cpu")
    assert meta.cu_seqlens_q.tolist() == [0, 5, 7]
    assert meta.seqused_k.tolist() == [15, 2]
    assert meta.block_table.tolist() == [[3], [1]]
    assert meta.write_idx.tolist() == [3 * 32 + p for p in range(10, 15)] + [32, 33]
    assert (meta.max_q, meta.max_k) == (5, 15)


def test_sdpa_mask_is_causal_within_run_and_hides_stale_keys():
    meta = build_metadata("sdpa", [0, 1], [2, 0], [2, 1], capacity=8, device="cpu")
    # Slot 0 holds 2 tokens and appends 2 (positions 2, 3); slot 1 appends 1 at position 0.
    assert meta.mask[:, 0].int().tolist() == [
        [[1, 1, 1, 0], [1, 1, 1, 1]],
        [[1, 0, 0, 0], [1, 0, 0, 0]],   # padded row of slot 1 still sees a key (no NaN)
    ]
    assert meta.pad_idx.tolist() == [0, 1, 2]


def test_sdpa_rows_for_spread_slots():
    # Slots 5 and 2 (span 4 <= 2 * 2): rows are cache slots 2..5, run order kept by pad_idx.
    meta = build_metadata("sdpa", [5, 2], [3, 1], [1, 1], capacity=8, device="cpu")
    assert (meta.slot_start, meta.batch, meta.pad_idx.tolist()) == (2, 4, [3, 0])
    assert meta.mask[:, 0, 0].int().tolist() == [
        [1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    # Slots 0 and 7 (span 8 > 4): gathered, two rows.
    meta = build_metadata("sdpa", [7, 0], [3, 3], [1, 1], capacity=8, device="cpu")
    assert (meta.slot_start, meta.batch, meta.pad_idx, meta.mask) == (None, 2, None, None)


def test_backend_switch():
    assert resolve_backend("auto", "cpu", torch.float32) == "sdpa"
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "sdpa"
    assert resolve_backend("sdpa", "cpu", torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("flash", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("xformers", "cpu", torch.float32)
