"""Sampling math: processed distributions, seeded randomness, sampling, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from support.reference_decode import chi2_pvalue

from pipeline.params import SamplingParams
from pipeline.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    SamplingTensors,
    compute_logprobs,
    derive_seed,
    draw_uniforms,
    gather_logprobs,
    process_logits,
    sample_from_weights,
    sample_tokens,
    top_logprobs,
)

PROBS5 = [0.5, 0.2, 0.15, 0.1, 0.05]


def _logits(probs: list[float]) -> torch.Tensor:  # [1, V]
    return torch.tensor(probs, dtype=torch.float64).log().float()[None, :]


def _process(logits, temperature=1.0, top_k=-1, top_p=1.0):
    rows = logits.shape[0]
    return process_logits(
        logits,
        torch.full((rows,), temperature),
        torch.full((rows,), top_k, dtype=torch.int64),
        torch.full((rows,), top_p),
    )


# -- processed distribution ------------------------------------------------------------------


def test_plain_softmax_when_everything_is_disabled():
    for top_k in (-1, 0, 5, 99):
        probs = _process(_logits(PROBS5), top_k=top_k)
        torch.testing.assert_close(probs[0], torch.tensor(PROBS5), atol=1e-6, rtol=0)


def test_top_k_keeps_the_k_largest_renormalised():
    probs = _process(_logits(PROBS5), top_k=3)
    expected = torch.tensor([0.5, 0.2, 0.15, 0.0, 0.0]) / 0.85
    torch.testing.assert_close(probs[0], expected, atol=1e-6, rtol=0)


def test_top_p_keeps_the_smallest_prefix_reaching_top_p():
    # cumulative mass 0.5, 0.7, 0.85, 0.95, 1.0
    expected = {
        0.3: [1.0, 0, 0, 0, 0],
        0.6: [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0],
        0.8: [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0],
        0.97: PROBS5,
    }
    for top_p, want in expected.items():
        probs = _process(_logits(PROBS5), top_p=top_p)
        torch.testing.assert_close(probs[0], torch.tensor(want), atol=1e-6, rtol=0)


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # after top-k=3: [0.588, 0.235, 0.176]; top_p=0.8 keeps two (0.588 + 0.235 = 0.82)
    probs = _process(_logits(PROBS5), top_k=3, top_p=0.8)
    torch.testing.assert_close(
        probs[0], torch.tensor([0.5 / 0.7, 0.2 / 0.7, 0, 0, 0]), atol=1e-6, rtol=0
    )


def test_temperature_scales_logits_before_filtering():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    probs = _process(logits, temperature=0.5)
    torch.testing.assert_close(probs[0], torch.softmax(torch.tensor([4.0, 2.0, 0.0]), -1))


def test_greedy_rows_are_one_hot_of_the_raw_argmax_and_rows_are_independent():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [0.1, 3.0, 2.9, -1.0]])
    probs = process_logits(
        logits, torch.tensor([0.0, 1.0]), torch.tensor([1, -1]), torch.tensor([0.1, 1.0])
    )
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))


def test_masked_logits_get_zero_probability():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    probs = _process(logits, top_k=3, top_p=0.99)
    assert probs[0, 1] == 0 and probs[0, 3] == 0
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_sampling_tensors_from_params():
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3)]
    st = SamplingTensors.from_params(params)
    assert st.greedy.tolist() == [True, False]
    assert st.top_k.tolist() == [-1, 5]
    assert st.seeds == [None, 3]
    sub = st.select(torch.tensor([1]))
    assert sub.seeds == [3] and sub.temperature.tolist() == pytest.approx([0.7])


# -- randomness --------------------------------------------------------------------------------


def test_derive_seed_separates_offsets_and_streams():
    seeds = {derive_seed(7, off, stream) for off in range(100) for stream in (0, 1)}
    assert len(seeds) == 200
    assert all(0 <= s < 2**64 for s in seeds)
    assert derive_seed(7, 3, STREAM_DRAFT) == derive_seed(7, 3, STREAM_DRAFT)


def test_seeded_uniforms_do_not_depend_on_the_batch():
    alone = draw_uniforms(16, [11], [5], STREAM_ACCEPT)
    mixed = draw_uniforms(16, [None, 99, 11, None], [0, 1, 5, 2], STREAM_ACCEPT)
    reordered = draw_uniforms(16, [11, 99], [5, 1], STREAM_ACCEPT)
    assert torch.equal(alone[0], mixed[2]) and torch.equal(alone[0], reordered[0])
    assert torch.equal(mixed[1], reordered[1])
    assert not torch.equal(mixed[1], mixed[2])


def test_seeded_uniforms_change_with_offset_and_stream():
    base = draw_uniforms(8, [11], [5], STREAM_ACCEPT)
    assert not torch.equal(base, draw_uniforms(8, [11], [6], STREAM_ACCEPT))
    assert not torch.equal(base, draw_uniforms(8, [11], [5], STREAM_DRAFT))
    assert ((base >= 0) & (base < 1)).all()


def test_unseeded_uniforms_follow_the_given_generator():
    a = draw_uniforms(8, [None, None], [0, 0], 0, generator=torch.Generator().manual_seed(1))
    b = draw_uniforms(8, [None, None], [0, 0], 0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a[0], a[1])


# -- sampling ----------------------------------------------------------------------------------


def test_sample_from_weights_matches_normalised_weights():
    weights = torch.tensor([3.0, 0.0, 1.0, 0.5, 1.5])  # unnormalised, one zero
    n = 40_000
    gen = torch.Generator().manual_seed(0)
    tokens = sample_from_weights(weights.expand(n, -1), torch.rand(n, 5, generator=gen))
    counts = torch.bincount(tokens, minlength=5)
    assert counts[1] == 0
    assert chi2_pvalue(counts, weights) > 1e-3


def test_sample_from_weights_check_has_power():
    # the same check rejects samples drawn from a slightly different distribution
    n = 40_000
    gen = torch.Generator().manual_seed(0)
    wrong = torch.tensor([3.3, 0.0, 1.0, 0.5, 1.2])
    tokens = sample_from_weights(wrong.expand(n, -1), torch.rand(n, 5, generator=gen))
    counts = torch.bincount(tokens, minlength=5)
    assert chi2_pvalue(counts, torch.tensor([3.0, 0.0, 1.0, 0.5, 1.5])) < 1e-6


def test_sample_tokens_follows_the_processed_distribution():
    n = 30_000
    logits = _logits(PROBS5).expand(n, -1)
    params = [SamplingParams(temperature=0.8, top_k=4, top_p=0.9)] * n
    gen = torch.Generator().manual_seed(1)
    tokens, probs = sample_tokens(logits, SamplingTensors.from_params(params), [0] * n, 0, gen)
    # reference: temperature 0.8, keep top 4, then nucleus 0.9 of those
    ref = torch.tensor(PROBS5[:4], dtype=torch.float64) ** (1 / 0.8)
    ref = ref / ref.sum()
    keep = (ref.cumsum(0) - ref) < 0.9
    ref = torch.where(keep, ref, torch.zeros_like(ref))
    ref = torch.cat([ref / ref.sum(), torch.zeros(1, dtype=torch.float64)])
    torch.testing.assert_close(probs[0].double(), ref, atol=1e-6, rtol=0)
    assert chi2_pvalue(torch.bincount(tokens, minlength=5), ref) > 1e-3


def test_sample_tokens_greedy_and_seeded_rows():
    logits = torch.tensor([[0.0, 2.0, 1.0]] * 3)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=1.0, seed=6),
    ]
    tokens, probs = sample_tokens(logits, SamplingTensors.from_params(params), [0, 4, 4])
    assert tokens[0] == 1 and probs[0].tolist() == [0.0, 1.0, 0.0]
    alone, _ = sample_tokens(logits[:1], SamplingTensors.from_params(params[1:2]), [4])
    assert alone[0] == tokens[1]
    # over many offsets a seeded row is still random, with the right frequencies
    sampling = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=5)] * 3000)
    toks, _ = sample_tokens(logits[:1].expand(3000, -1), sampling, list(range(3000)))
    counts = torch.bincount(toks, minlength=3)
    assert chi2_pvalue(counts, torch.softmax(logits[0].double(), -1)) > 1e-3


# -- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = _logits(PROBS5) + 3.0  # shift: log_softmax is invariant
    logprobs = compute_logprobs(logits)
    expected = [math.log(p) for p in PROBS5]
    assert gather_logprobs(logprobs, torch.tensor([2])).tolist() == pytest.approx([expected[2]])
    ids, values = top_logprobs(logprobs, 3)
    assert ids.tolist() == [[0, 1, 2]]
    assert values[0].tolist() == pytest.approx(expected[:3], abs=1e-6)
    ids, _ = top_logprobs(logprobs, 20)
    assert ids.shape == (1, 5)
