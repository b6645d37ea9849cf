"""Speculative acceptance: greedy literals, lossless rejection sampling (with a power check),
seeded determinism, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.acceptance_cases import (
    CASES,
    Q_FAR,
    Q_NEAR,
    Case,
    N,
    P,
    V,
    logits_of,
    lossless_pvalues,
    make_batch,
)
from support.reference_decode import chi2_pvalue

from pipeline.params import SamplingParams
from pipeline.sampling import (
    SamplingTensors,
    position_uniforms,
    process_logits,
    sample_from_weights,
)
from pipeline.verify.acceptance import (
    accept,
    accept_greedy_packed,
    greedy_accept,
    position_accept,
    rejection_accept,
)

# -- greedy ------------------------------------------------------------------------------------


def _greedy(drafts, num_drafts, argmax):
    tokens, num = greedy_accept(
        torch.tensor(drafts), torch.tensor(num_drafts), torch.tensor(argmax)
    )
    return tokens.tolist(), num.tolist()


def test_greedy_all_accepted_plus_bonus():
    assert _greedy([[3, 1, 4]], [3], [[3, 1, 4, 1]]) == ([[3, 1, 4, 1]], [4])


def test_greedy_first_draft_rejected_gives_the_correction_only():
    assert _greedy([[2, 1, 4]], [3], [[3, 1, 4, 1]]) == ([[3, -1, -1, -1]], [1])


def test_greedy_middle_draft_rejected():
    assert _greedy([[3, 0, 4]], [3], [[3, 1, 4, 1]]) == ([[3, 1, -1, -1]], [2])


def test_greedy_zero_drafts_is_just_the_target_token():
    assert _greedy([[]], [0], [[7]]) == ([[7]], [1])


def test_greedy_mixed_batch_with_different_draft_lengths():
    drafts = [[5, 6, 7], [5, 9, 9], [8, 99, 99], [1, 99, 99]]  # 99 = padding past k_i
    num_drafts = [3, 1, 1, 0]
    argmax = [[5, 6, 7, 8], [5, 9, 0, 0], [8, 99, 3, 3], [2, 3, 3, 3]]
    assert _greedy(drafts, num_drafts, argmax) == (
        [[5, 6, 7, 8], [5, 9, -1, -1], [8, 99, -1, -1], [2, -1, -1, -1]],
        [4, 2, 2, 1],
    )


def _peaked_logits(argmax: list[list[int]], vocab: int) -> torch.Tensor:  # [B, K+1, V]
    """Logits 0, -1, -2, ... with 5.0 at each position's argmax."""
    logits = -torch.arange(vocab, dtype=torch.float32).expand(len(argmax), len(argmax[0]), -1)
    return logits.scatter(-1, torch.tensor(argmax)[..., None], 5.0)


def _logprob(argmax: int, token: int, vocab: int) -> float:
    logits = [5.0 if i == argmax else -float(i) for i in range(vocab)]
    return logits[token] - math.log(sum(math.exp(x) for x in logits))


def test_accept_greedy_rows_with_logprobs_and_top_logprobs():
    argmax = [[3, 1, 4, 1], [2, 2, 2, 2]]
    logits = _peaked_logits(argmax, vocab=5)
    drafts = torch.tensor([[3, 1, 0], [2, 0, 0]])
    sampling = SamplingTensors.from_params([SamplingParams(), SamplingParams(seed=3)])
    res = accept(drafts, torch.tensor([3, 1]), logits, sampling, [0, 0], num_top_logprobs=2)
    assert res.token_lists() == [[3, 1, 4], [2, 2]]
    assert res.num_accepted.tolist() == [2, 1]
    assert res.logprob_lists() == [
        pytest.approx([_logprob(3, 3, 5), _logprob(1, 1, 5), _logprob(4, 4, 5)], rel=1e-4),
        pytest.approx([_logprob(2, 2, 5)] * 2, rel=1e-4),
    ]
    lists = res.top_logprob_lists([2, 1])
    assert [[pair[0] for pair in tok] for tok in lists[0]] == [[3, 0], [1, 0], [4, 0]]
    assert lists[0][0][1][1] == pytest.approx(_logprob(3, 0, 5), rel=1e-4)
    assert [[pair[0] for pair in tok] for tok in lists[1]] == [[2], [2]]


@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.integers(0, 2**31 - 1),
       st.integers(0, 3))
def test_packed_greedy_accept_equals_the_padded_one(num_drafts, seed, top_n):
    """The verifier's packed path (argmax and logprobs over the verified rows only) gives what
    `accept` gives on the same logits padded to [B, K+1, V]: tokens, counts, logprobs, top-N."""
    gen = torch.Generator().manual_seed(seed)
    vocab, width = 7, max(num_drafts)
    runs = [torch.randn(k + 1, vocab, generator=gen) for k in num_drafts]
    padded = torch.zeros(len(runs), width + 1, vocab)
    drafts = torch.zeros(len(runs), width, dtype=torch.int64)
    for i, (lg, k) in enumerate(zip(runs, num_drafts)):
        padded[i, : k + 1] = lg
        # drafts that mostly follow the argmax, so accepted prefixes of every length occur
        follow = lg[:k].argmax(-1)
        noise = torch.randint(0, vocab, (k,), generator=gen)
        coin = torch.rand(k, generator=gen) < 0.8
        drafts[i, :k] = torch.where(coin, follow, noise)
    counts = torch.tensor(num_drafts)
    sampling = SamplingTensors.from_params([SamplingParams()] * len(runs))
    want = accept(drafts, counts, padded, sampling, [0] * len(runs), num_top_logprobs=top_n)
    got = accept_greedy_packed(drafts, counts, torch.cat(runs), top_n)
    assert got.token_lists() == want.token_lists()
    assert torch.equal(got.num_tokens, want.num_tokens)
    assert torch.allclose(got.logprobs, want.logprobs, equal_nan=True)
    if top_n:
        for i, n in enumerate(want.num_tokens.tolist()):
            assert torch.equal(got.top_ids[i, :n], want.top_ids[i, :n])
            assert torch.allclose(got.top_values[i, :n], want.top_values[i, :n])


def test_packed_greedy_accept_rejects_logits_of_another_batch():
    with pytest.raises(ValueError, match="sum\\(num_drafts \\+ 1\\) = 4"):
        accept_greedy_packed(torch.zeros(2, 2, dtype=torch.int64), torch.tensor([2, 0]),
                             torch.zeros(5, 3))


def test_accept_greedy_ignores_draft_probs():
    logits = _peaked_logits([[1, 2]], vocab=3)
    q = torch.tensor([[[0.0, 0.0, 1.0]]])  # q says the draft is impossible under itself
    res = accept(
        torch.tensor([[1]]), torch.tensor([1]), logits,
        SamplingTensors.from_params([SamplingParams()]), [0], draft_probs=q,
    )  # fmt: skip
    assert res.token_lists() == [[1, 2]]


def test_greedy_rows_keep_their_literal_result_next_to_sampled_rows():
    argmax = [[3, 1, 4], [0, 0, 0], [3, 1, 4]]
    logits = _peaked_logits(argmax, vocab=5)
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(top_k=1)]
    res = accept(
        torch.tensor([[3, 2], [1, 1], [3, 2]]), torch.tensor([2, 2, 1]), logits,
        SamplingTensors.from_params(params), [0, 0, 0],
    )  # fmt: skip
    lists = res.token_lists()
    assert lists[0] == [3, 1] and lists[2] == [3, 1]
    assert 1 <= len(lists[1]) <= 3


def test_accept_prefill_has_no_drafts():
    logits = torch.tensor([[[0.0, 5.0, 1.0]]])
    sampling = SamplingTensors.from_params([SamplingParams()])
    res = accept(torch.zeros(1, 0, dtype=torch.int64), torch.tensor([0]), logits, sampling, [0])
    assert res.token_lists() == [[1]] and res.num_accepted.tolist() == [0]


def test_accept_rejects_inconsistent_shapes():
    sampling = SamplingTensors.from_params([SamplingParams()])
    logits = torch.zeros(1, 3, 4)
    with pytest.raises(ValueError, match="target_logits"):
        accept(torch.zeros(1, 1, dtype=torch.int64), torch.tensor([1]), logits, sampling, [0])
    with pytest.raises(ValueError, match="num_drafts"):
        accept(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([3]), logits, sampling, [0])
    with pytest.raises(ValueError, match="draft token ids"):
        accept(torch.tensor([[0, 4]]), torch.tensor([2]), logits, sampling, [0])
    with pytest.raises(ValueError, match="draft_probs"):
        accept(
            torch.zeros(1, 2, dtype=torch.int64), torch.tensor([2]), logits, sampling, [0],
            draft_probs=torch.zeros(1, 2, 5),
        )  # fmt: skip


# -- rejection sampling edge cases -------------------------------------------------------------


def test_draft_with_zero_target_probability_is_always_rejected():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]]).expand(1000, -1, -1)
    q = torch.tensor([[[0.0, 0.0, 1.0]]]).expand(1000, -1, -1)
    drafts = torch.full((1000, 1), 2)
    u_acc, u_s = torch.rand(1000, 1), torch.rand(1000, 3)
    tokens, num = rejection_accept(drafts, torch.ones(1000, dtype=torch.int64), p, q, u_acc, u_s)
    assert num.eq(1).all() and tokens[:, 0].lt(2).all()


def test_draft_with_zero_draft_probability_is_accepted():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    q = torch.tensor([[[0.0, 0.0, 1.0]]])
    tokens, num = rejection_accept(
        torch.tensor([[0]]), torch.tensor([1]), p, q, torch.tensor([[0.999]]), torch.rand(1, 3)
    )
    assert tokens.tolist() == [[0, 2]] and num.tolist() == [2]


def test_all_zero_residual_falls_back_to_p():
    # unnormalised q >= p everywhere: the residual is all zero, sample from p instead
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.25] * 4]])
    q = torch.tensor([[[0.0, 0.6, 0.6, 0.0]]])
    for seed in range(5):
        u_s = torch.rand(1, 4, generator=torch.Generator().manual_seed(seed))
        tokens, num = rejection_accept(torch.tensor([[1]]), torch.tensor([1]), p, q,
                                       torch.tensor([[0.99]]), u_s)  # fmt: skip
        assert num.tolist() == [1] and tokens[0, 0].item() in (1, 2)


# -- losslessness: distribution of generated tokens vs the target's processed distribution -----

def run_accept(case: Case, seed: int = 0) -> tuple[list[float], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits, p, q, drafts, num_drafts = make_batch(case, gen)
    params = SamplingParams(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p)
    sampling = SamplingTensors.from_params([params] * N)
    res = accept(drafts, num_drafts, logits, sampling, [0] * N, q, generator=gen)
    return lossless_pvalues(res.token_ids, res.num_tokens, p), res.num_tokens


@pytest.mark.parametrize("name", list(CASES))
def test_rejection_sampling_is_lossless(name):
    pvalues, num_tokens = run_accept(CASES[name])
    assert len(pvalues) >= 2, "first and second tokens must both be checked"
    assert min(pvalues) > 1e-3, pvalues
    # the drafts were neither all accepted nor all rejected
    assert 0 < float((num_tokens > 1).float().mean()) < 0.75


def test_point_mass_draft_acceptance_rate_is_p_of_the_draft():
    # n-gram drafts: draft x is accepted with probability exactly p(x)
    _, num_tokens = run_accept(CASES["point_mass"])
    has_draft = (torch.arange(N) % 4) > 0
    rate = float((num_tokens[has_draft] > 1).float().mean())
    assert abs(rate - P[0][1]) < 0.01


def test_model_draft_acceptance_rate_is_one_minus_total_variation():
    # min(1, p/q) accepts a q-sampled draft with probability sum_x min(p(x), q(x))
    _, num_tokens = run_accept(CASES["q_near"])
    has_draft = (torch.arange(N) % 4) > 0
    rate = float((num_tokens[has_draft] > 1).float().mean())
    overlap = sum(min(a, b) for a, b in zip(P[0], Q_NEAR[0]))
    assert overlap == pytest.approx(0.88)
    assert abs(rate - overlap) < 0.01


def test_disjoint_supports_reject_every_draft_and_still_follow_p():
    # after temperature 0.7 / top-k 4 / top-p 0.9, q keeps tokens {4, 5} and p keeps {0..3}
    pvalues, num_tokens = run_accept(Case(P, Q_FAR, temperature=0.7, top_k=4, top_p=0.9))
    assert num_tokens.eq(1).all()
    assert len(pvalues) == 1 and pvalues[0] > 1e-3


def test_seeded_rows_are_lossless_too():
    n = 5000
    gen = torch.Generator().manual_seed(5)
    q = torch.tensor(Q_NEAR[0])
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)[:, None]
    sampling = SamplingTensors.from_params(
        [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    )
    res = accept(
        drafts, torch.ones(n, dtype=torch.int64), logits_of(P[:2]).expand(n, -1, -1), sampling,
        [3] * n, q.expand(n, 1, -1),
    )  # fmt: skip
    counts = torch.bincount(res.token_ids[:, 0], minlength=V)
    assert chi2_pvalue(counts, torch.tensor(P[0])) > 1e-3


def _wrong_rule(drafts, num_drafts, p, q, u_acc, u_samp, variant: str):
    """A test-side rejection sampler: 'correct', or one of the classic mistakes."""
    n, k = drafts.shape
    rows = torch.arange(n)
    if q is None:
        q = torch.nn.functional.one_hot(drafts, V).float()
    px = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    qx = q.gather(-1, drafts[..., None]).squeeze(-1)
    valid = torch.arange(k)[None, :] < num_drafts[:, None]
    if variant == "always_accept":
        ok = valid
    elif variant == "accept_p_x_with_q_residual":
        ok = (u_acc < px) & valid
    else:
        ok = (u_acc * qx < px) & valid
    n_acc = ok.long().cumprod(1).sum(1)
    rejected = n_acc < num_drafts
    pos = n_acc
    if variant == "bonus_from_last_draft_position":
        pos = torch.where(~rejected & (num_drafts > 0), num_drafts - 1, n_acc)
    p_fin = p[rows, pos]
    residual = (p_fin - q[rows, n_acc.clamp(max=k - 1)]).clamp_min(0)
    if variant == "resample_from_p":
        residual = p_fin
    final = sample_from_weights(torch.where(rejected[:, None], residual, p_fin), u_samp)
    tokens = torch.cat([drafts, torch.full((n, 1), -1)], 1)
    tokens[rows, n_acc] = final
    return tokens, n_acc + 1


def run_rule(case: Case, variant: str, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    _, p, q, drafts, num_drafts = make_batch(case, gen)
    u_acc, u_samp = torch.rand(N, 2, generator=gen), torch.rand(N, V, generator=gen)
    tokens, num = _wrong_rule(drafts, num_drafts, p.expand(N, -1, -1), q, u_acc, u_samp, variant)
    return lossless_pvalues(tokens, num, p)


def test_reference_rule_in_this_file_passes_the_check():
    for name in ("q_near", "point_mass"):
        assert min(run_rule(CASES[name], "correct")) > 1e-3


@pytest.mark.parametrize(
    ("variant", "name"),
    [
        ("always_accept", "q_near"),
        ("always_accept", "point_mass"),
        ("resample_from_p", "q_near"),
        ("resample_from_p", "point_mass"),
        ("accept_p_x_with_q_residual", "q_far"),
        ("bonus_from_last_draft_position", "q_near"),
    ],
)
def test_wrong_acceptance_rules_fail_the_same_check(variant, name):
    assert min(run_rule(CASES[name], variant)) < 1e-6


# -- seeded determinism ------------------------------------------------------------------------


def _seeded_batch(order: list[int], extra_unseeded: int = 0, pad_to: int = 3):
    """Requests 0..3 (seeded, distinct logits and drafts) in `order`, plus unseeded rows."""
    gen = torch.Generator().manual_seed(123)
    all_logits = torch.randn(4, 4, 7, generator=gen)
    all_drafts = torch.randint(0, 7, (4, 3), generator=gen)
    all_logits = torch.cat([all_logits, torch.randn(extra_unseeded, 4, 7)])
    all_drafts = torch.cat([all_drafts, torch.randint(0, 7, (extra_unseeded, 3))])
    k = [3, 2, 0, 1] + [3] * extra_unseeded
    seeds = [10, 11, 12, 10] + [None] * extra_unseeded
    pos = [0, 5, 9, 7] + [0] * extra_unseeded
    idx = order + list(range(4, 4 + extra_unseeded))
    params = [SamplingParams(temperature=0.9, top_k=5, seed=seeds[i]) for i in idx]
    logits = torch.zeros(len(idx), pad_to + 1, 7)
    logits[:, :4] = all_logits[idx]
    drafts = torch.zeros(len(idx), pad_to, dtype=torch.int64)
    drafts[:, :3] = all_drafts[idx]
    q = torch.softmax(torch.randn(len(idx), pad_to, 7), -1)
    q[:, :3] = torch.softmax(all_logits[idx, :3] * 0.5, -1)
    res = accept(
        drafts, torch.tensor([k[i] for i in idx]), logits,
        SamplingTensors.from_params(params), [pos[i] for i in idx], q,
    )  # fmt: skip
    lists = res.token_lists()
    return {i: lists[j] for j, i in enumerate(order)}


def test_seeded_requests_do_not_depend_on_batch_order_or_composition():
    base = _seeded_batch([0, 1, 2, 3])
    assert _seeded_batch([0, 1, 2, 3]) == base
    assert _seeded_batch([3, 1, 0, 2]) == base
    assert _seeded_batch([2, 0], extra_unseeded=5) == {i: base[i] for i in (2, 0)}
    assert _seeded_batch([1, 3], pad_to=6) == {i: base[i] for i in (1, 3)}


def test_seeded_request_output_varies_with_its_seed_and_position():
    logits = torch.zeros(200, 1, 50)  # uniform target, no drafts: one token per row
    seeded = [SamplingParams(temperature=1.0, seed=s) for s in range(100)] * 2
    res = accept(
        torch.zeros(200, 0, dtype=torch.int64), torch.zeros(200, dtype=torch.int64), logits,
        SamplingTensors.from_params(seeded), [0] * 100 + [1] * 100,
    )  # fmt: skip
    tokens = res.token_ids[:, 0]
    assert len(set(tokens[:100].tolist())) > 30  # different seeds, different tokens
    assert not torch.equal(tokens[:100], tokens[100:])  # same seeds, other position


# -- seeded rows: position-keyed sampling ------------------------------------------------------


def _seeded_case_run(case: Case, n: int = 20_000, coupled: bool = False):
    """n seeded rows (seed = row) of `case` at output position 3: drafts cycle 0, 1, 2, 2 per
    row. Model drafts are sampled from each row's own position noise (`coupled`, what a seeded
    draft model does) or from an unrelated generator. Returns (tokens, num_tokens, p, drafts)."""
    params = SamplingParams(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p)
    sampling = SamplingTensors.from_params([params] * 3)
    p = process_logits(logits_of(case.target), sampling.temperature, sampling.top_k, sampling.top_p)
    num_drafts = (torch.arange(n) % 4).clamp(max=2)
    q = None
    if case.draft is None:
        drafts = torch.tensor(case.ngram_drafts).expand(n, -1)
    else:
        q = process_logits(
            logits_of(case.draft), sampling.temperature[:2], sampling.top_k[:2], sampling.top_p[:2]
        )
        if coupled:
            noise = torch.stack([position_uniforms(s, 3, 2, V) for s in range(n)])  # [n, 2, V]
            drafts = torch.stack([sample_from_weights(q[j].expand(n, -1), noise[:, j])
                                  for j in range(2)], 1)
        else:
            gen = torch.Generator().manual_seed(9)
            drafts = torch.stack(
                [torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(2)], 1
            )
        q = q.expand(n, -1, -1)
    seeded = SamplingTensors.from_params(
        [SamplingParams(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p,
                        seed=s) for s in range(n)])
    res = accept(drafts, num_drafts, logits_of(case.target).expand(n, -1, -1), seeded, [3] * n, q)
    return res.token_ids, res.num_tokens, p, drafts


@pytest.mark.parametrize("name", list(CASES))
def test_seeded_rows_follow_the_target_distribution(name):
    # chi-square over seeds, as for the unseeded rows: first, second and third token ~ p
    tokens, num_tokens, p, _ = _seeded_case_run(CASES[name], coupled=True)
    pvalues = lossless_pvalues(tokens, num_tokens, p)
    assert len(pvalues) >= 2 and min(pvalues) > 1e-3, pvalues


@pytest.mark.parametrize("name", ["point_mass", "point_mass_unlikely_draft", "q_near", "q_far"])
def test_seeded_rows_output_the_same_tokens_whatever_was_drafted(name):
    # each row's tokens are the target's position samples: those of drafting nothing
    tokens, num_tokens, p, _ = _seeded_case_run(CASES[name], n=2000, coupled=True)
    for j in range(3):
        rows = num_tokens > j
        # without drafts, position 3 + j is row j of the undrafted run at position 3 + j
        undrafted = torch.stack([
            sample_from_weights(p[j][None], position_uniforms(s, 3 + j, 1, V))[0]
            for s in torch.nonzero(rows).squeeze(-1).tolist()])
        assert torch.equal(tokens[rows, j], undrafted)


def test_seeded_point_mass_acceptance_rate_is_p_of_the_draft():
    # the same acceptance as rejection sampling: draft x kept with probability p(x)
    _, num_tokens, _, _ = _seeded_case_run(CASES["point_mass"], n=N)
    has_draft = (torch.arange(N) % 4) > 0
    rate = float((num_tokens[has_draft] > 1).float().mean())
    assert abs(rate - P[0][1]) < 0.01


def test_seeded_model_drafts_cost_acceptance_within_the_gumbel_coupling_bound():
    # coupled drafts are kept with probability between (1 - TV) / (1 + TV) and 1 - TV
    _, num_tokens, _, _ = _seeded_case_run(CASES["q_near"], n=N, coupled=True)
    has_draft = (torch.arange(N) % 4) > 0
    rate = float((num_tokens[has_draft] > 1).float().mean())
    tv = 1 - sum(min(a, b) for a, b in zip(P[0], Q_NEAR[0]))
    assert (1 - tv) / (1 + tv) - 0.01 < rate < 1 - tv + 0.01, (rate, tv)
    # uncoupled drafts (sampled from other noise) match only by chance: sum_x p(x) q(x)
    _, num_tokens, _, _ = _seeded_case_run(CASES["q_near"], n=N, coupled=False)
    chance = sum(a * b for a, b in zip(P[0], Q_NEAR[0]))
    rate = float((num_tokens[has_draft] > 1).float().mean())
    assert abs(rate - chance) < 0.01


def test_position_accept_literals():
    # position samples 4, 1, 0 (peaked p, uniform noise): drafts kept while equal
    p = torch.nn.functional.one_hot(torch.tensor([[4, 1, 0]]), 5).float()
    u = torch.full((1, 3, 5), 0.5)
    tokens, num = position_accept(torch.tensor([[4, 2]]), torch.tensor([2]), p, u)
    assert tokens.tolist() == [[4, 1, -1]] and num.tolist() == [2]
    tokens, num = position_accept(torch.tensor([[4, 1]]), torch.tensor([2]), p, u)
    assert tokens.tolist() == [[4, 1, 0]] and num.tolist() == [3]
