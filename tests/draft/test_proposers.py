"""Proposers behind one interface: n-gram lookup, a draft model with KV rollback, none."""

from __future__ import annotations

import pytest
import torch
from support.reference_decode import greedy_reference

from pipeline.config import load_config
from pipeline.draft.model import DraftModelProposer
from pipeline.draft.ngram import NgramProposer
from pipeline.draft.none import NoProposer
from pipeline.draft.step import build_proposer, draft_step
from pipeline.models.runners import build_runner
from pipeline.params import SamplingParams
from pipeline.protocol import NewRequest, StepPlan
from pipeline.sampling import position_uniforms, sample_from_weights

GREEDY = SamplingParams()


def test_ngram_drafts_what_followed_the_last_match_and_sees_committed_tokens():
    p = NgramProposer(min_n=1, max_n=3)
    p.add("a", [10, 11, 12, 13, 14, 10, 11], GREEDY)
    assert p.propose(["a"], [3]).tokens == [[12, 13, 14]]
    p.commit("a", [12, 99])  # the sequence is now ... 10 11 12 99
    assert p.propose(["a"], [2]).tokens == [[]]  # no earlier "99"
    p.commit("a", [10])
    assert p.propose(["a"], [4]).tokens == [[11, 12, 99, 10]]
    assert p.propose(["a"], [0]).tokens == [[]]
    p.remove("a")
    p.remove("a")  # unknown: ignored


def test_no_proposer_drafts_nothing():
    p = NoProposer()
    p.add("a", [1, 2], GREEDY)
    assert p.propose(["a", "b"], [4, 4]).tokens == [[], []]


@pytest.fixture(scope="module")
def pair():
    config = load_config("configs/tiny.yaml", {"draft_agreement_noise": 0.0, "num_slots": 4})
    return build_runner(config, "draft"), build_runner(config, "target")


def test_identical_draft_model_proposes_the_target_greedy_continuation(pair):
    draft, target = pair
    prompt = [5, 6, 7, 8]
    ref = greedy_reference(target, prompt, 9)
    p = DraftModelProposer(draft)
    p.add("a", prompt, GREEDY)
    p.commit("a", ref[:1])
    assert p.propose(["a"], [4]).tokens == [ref[1:5]]
    p.remove("a")
    assert draft.num_free() == 4


def test_rollback_keeps_only_the_confirmed_cache_prefix(pair):
    draft, target = pair
    prompt = [40, 41, 42]
    ref = greedy_reference(target, prompt, 12)
    p = DraftModelProposer(draft)
    p.add("a", prompt, GREEDY)
    p.commit("a", ref[:1])
    drafts = p.propose(["a"], [4]).tokens[0]
    slot = p._seqs["a"].slot
    assert draft.length(slot) == len(prompt) + 1 + 3  # seq + 3 fed-back drafts
    # The verifier accepted 1 draft, then corrected: the cache keeps seq + that draft only.
    p.commit("a", [drafts[0], 7])
    assert draft.length(slot) == len(prompt) + 2
    # Proposals after the rollback equal a fresh proposer's on the same sequence.
    seq_out = ref[:1] + [drafts[0], 7]
    fresh = DraftModelProposer(draft)
    fresh.add("b", prompt, GREEDY)
    fresh.commit("b", seq_out)
    assert p.propose(["a"], [3]).tokens == fresh.propose(["b"], [3]).tokens
    p.remove("a")
    fresh.remove("b")


def test_batched_proposals_with_different_k_match_single_requests(pair):
    draft, _ = pair
    prompts = {"a": [3, 4, 5], "b": [60], "c": [9, 9, 9, 9, 9]}
    ks = {"a": 4, "b": 0, "c": 2}
    single = {}
    for rid, prompt in prompts.items():
        p = DraftModelProposer(draft)
        p.add(rid, prompt, GREEDY)
        single[rid] = p.propose([rid], [ks[rid]]).tokens[0]
        p.remove(rid)
    p = DraftModelProposer(draft)
    for rid, prompt in prompts.items():
        p.add(rid, prompt, GREEDY)
    batched = p.propose(list(prompts), [ks[r] for r in prompts])
    assert dict(zip(prompts, batched.tokens)) == single
    assert batched.probs == [None, None, None]  # greedy drafts are point masses
    assert [len(single[r]) for r in prompts] == [4, 0, 2]


def test_sampled_drafts_carry_their_distribution_q(pair):
    draft, _ = pair
    p = DraftModelProposer(draft)
    p.add("s", [3, 4], SamplingParams(temperature=0.7))
    out = p.propose(["s"], [3])
    q = out.probs[0]
    assert q.shape == (3, draft.vocab_size)
    assert torch.allclose(q.sum(-1), torch.ones(3), atol=1e-5)
    assert all(q[i, t] > 0 for i, t in enumerate(out.tokens[0]))
    p.remove("s")


def test_seeded_drafts_come_from_the_target_position_noise_and_carry_no_q(pair):
    # coupled with the target's sample at the same output position (acceptance "Seeded rows")
    draft, _ = pair
    p = DraftModelProposer(draft)
    p.add("u", [3, 4], SamplingParams(temperature=0.7))
    q0 = p.propose(["u"], [1]).probs[0][0]  # the draft distribution at output position 0
    p.remove("u")
    p.add("s", [3, 4], SamplingParams(temperature=0.7, seed=5))
    out = p.propose(["s"], [3])
    assert out.probs == [None]
    expected = sample_from_weights(q0[None], position_uniforms(5, 0, 1, draft.vocab_size))
    assert out.tokens[0][0] == int(expected[0])
    p.remove("s")
    p.add("s", [3, 4], SamplingParams(temperature=0.7, seed=5))
    assert p.propose(["s"], [3]).tokens == out.tokens
    p.remove("s")


@pytest.mark.parametrize("kind", ["ngram", "model", "none"])
def test_draft_step_applies_release_new_and_commits_in_order(kind):
    config = load_config("configs/tiny.yaml", {"draft": kind, "num_slots": 2, "ngram_min_n": 1})
    proposer = build_proposer(config)
    plan = StepPlan(step=0, new=[NewRequest("a", [5, 6, 5], GREEDY)])
    assert draft_step(proposer, plan).tokens == []
    plan = StepPlan(step=1, decode=["a"], ks=[2], commits={"a": [6]})
    drafts = draft_step(proposer, plan).tokens
    assert len(drafts) == 1 and len(drafts[0]) <= (0 if kind == "none" else 2)
    if kind == "ngram":
        assert drafts == [[5, 6]]
    plan = StepPlan(step=2, release=["a"], new=[NewRequest("b", [1], GREEDY),
                                                NewRequest("c", [2], GREEDY)])
    draft_step(proposer, plan)  # a's slot is free again before b and c take two
    if kind == "model":  # b and c hold both slots
        assert proposer.runner.num_free() == 0


@pytest.mark.parametrize("path", [None, "configs/smollm2-cpu.yaml"])
def test_the_default_ngram_drafter_drafts_only_after_a_match_of_three_tokens(path):
    """Shorter matches are left out by default: on the copy workload 8 drafts after a 1-token
    match kept 0.65 tokens, after a 3-token match 4.6 (configs/smollm2-cpu.yaml)."""
    proposer = build_proposer(load_config(path, {"draft": "ngram"}))
    text = [7, 1, 2, 3, 8, 9, 4, 2, 3]  # "2 3" recurs, "1 2 3" does not yet
    proposer.add("r", text, GREEDY)
    assert proposer.propose(["r"], [4]).tokens == [[]]
    proposer.commit("r", [9, 1, 2, 3])  # now "1 2 3" recurs: it was followed by 8 9 4 2
    assert proposer.propose(["r"], [4]).tokens == [[8, 9, 4, 2]]
