"""Drafting with an EAGLE-3 head: chained drafts equal a recompute from scratch, the per-request
head KV rolls back by length, and batching requests changes nothing."""

from __future__ import annotations

import itertools
import operator

import pytest
import torch
from support.eagle3_heads import tiny_target_config, write_layout

from pipeline.draft.eagle3 import Eagle3Drafter, HeadDrafts, HeadStep, load_eagle3_head
from pipeline.models.tiny import tiny_model

TARGET = tiny_target_config()
AUX = 3 * TARGET.hidden_size


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    folder = write_layout(tmp_path_factory.mktemp("head"), "speculators", TARGET, seed=7)
    return load_eagle3_head(str(folder), TARGET, tiny_model(TARGET).embed.weight.detach())


def positions(n: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """n kept positions: their aux hidden states and the token after each."""
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(n, AUX, generator=gen)
    return aux, torch.randint(0, TARGET.vocab_size, (n,), generator=gen).tolist()


def propose_one(drafter, rid, start, aux, tokens, k):
    out = drafter.propose([rid], [HeadStep(start, aux, tokens)], [k])
    return out.tokens[0], out.probs[0]


def fresh(head, aux, tokens, k):
    drafter = Eagle3Drafter(head)
    drafter.add("r")
    return propose_one(drafter, "r", 0, aux, tokens, k)


def assert_same(a, b):
    assert a[0] == b[0]
    assert a[1] == pytest.approx(b[1], rel=1e-4, abs=1e-6)


@torch.no_grad()
def test_chained_drafts_equal_a_recompute_from_scratch(head):
    """Each draft recomputed from an empty cache over every pair so far, draft pairs carrying
    the previous position's output hidden state: what caching and chaining must equal."""
    aux, tokens = positions(9, seed=1)
    ids, hidden = list(tokens), head.fuse(aux)
    expected, probs = [], []
    for _ in range(5):
        out = head(torch.tensor(ids), hidden, [head.new_cache()], [len(ids)])
        p = head.logits(out[-1:]).softmax(-1)[0]
        draft = int(p.argmax())
        expected.append(draft + int(head.d2t[draft]))
        probs.append(float(p.max()))
        ids.append(expected[-1])
        hidden = torch.cat([hidden, out[-1:]])
    assert_same(fresh(head, aux, tokens, 5), (expected, probs))
    assert len(set(expected)) > 1  # the chain is not one repeated token


def test_feeding_positions_step_by_step_equals_feeding_them_at_once(head):
    aux, tokens = positions(10, seed=2)
    drafter = Eagle3Drafter(head)
    drafter.add("r")
    for start, end in [(0, 4), (4, 5), (5, 8)]:
        propose_one(drafter, "r", start, aux[start:end], tokens[start:end], 3)
        assert drafter.length("r") == end  # draft pairs are not kept
    assert_same(propose_one(drafter, "r", 8, aux[8:], tokens[8:], 4),
                fresh(head, aux, tokens, 4))


def test_after_a_rollback_proposing_equals_a_fresh_cache_on_the_same_prefix(head):
    aux, tokens = positions(8, seed=3)
    other_aux, other_tokens = positions(4, seed=4)
    drafter = Eagle3Drafter(head)
    drafter.add("r")
    propose_one(drafter, "r", 0, aux, tokens, 3)
    drafter.truncate("r", 5)
    got = propose_one(drafter, "r", 5, other_aux, other_tokens, 4)
    want = fresh(head, torch.cat([aux[:5], other_aux]), tokens[:5] + other_tokens, 4)
    assert_same(got, want)
    # a step that starts inside what the head holds rolls it back by itself
    propose_one(drafter, "r", 9, aux[:2], tokens[:2], 2)
    assert drafter.length("r") == 11
    assert_same(propose_one(drafter, "r", 5, other_aux, other_tokens, 4), want)


def test_a_batch_drafts_what_each_request_drafts_alone(head):
    steps = [positions(n, seed) for n, seed in [(6, 5), (2, 6), (4, 7)]]
    ks = [4, 0, 2]
    drafter = Eagle3Drafter(head)
    for rid in "abc":
        drafter.add(rid)
    out = drafter.propose(list("abc"), [HeadStep(0, a, t) for a, t in steps], ks)
    for i, ((aux, tokens), k) in enumerate(zip(steps, ks)):
        assert_same((out.tokens[i], out.probs[i]), fresh(head, aux, tokens, k) if k else ([], []))
    assert [drafter.length(r) for r in "abc"] == [6, 2, 4]  # k = 0 still feeds its positions


def test_drafts_are_target_ids_of_the_draft_vocabulary_and_q_lives_there(head):
    aux, tokens = positions(5, seed=8)
    drafted, probs = fresh(head, aux, tokens, 6)
    assert head.t2d[drafted].all() and all(0 < p <= 1 for p in probs)
    proposal = HeadDrafts([drafted, []], [probs, []]).to_proposal()
    assert proposal.tokens == [drafted, []] and proposal.probs is None
    assert proposal.confidence[0] == pytest.approx(list(itertools.accumulate(probs,
                                                                             operator.mul)))
    assert proposal.confidence[1] == []
    q = head.to_target_vocab(torch.softmax(torch.randn(2, head.config.draft_vocab_size), -1))
    assert q.shape == (2, TARGET.vocab_size)
    assert torch.allclose(q.sum(-1), torch.ones(2))
    assert not q[:, ~head.t2d].any()


def test_a_step_past_what_the_head_holds_or_with_rows_missing_is_refused(head):
    aux, tokens = positions(4, seed=9)
    drafter = Eagle3Drafter(head)
    drafter.add("r")
    drafter.add("s")
    propose_one(drafter, "r", 0, aux, tokens, 1)
    with pytest.raises(ValueError, match="'s' step starts at position 2, the head holds 0"):
        drafter.propose(["r", "s"], [HeadStep(1, aux, tokens), HeadStep(2, aux, tokens)], [1, 1])
    assert drafter.length("r") == 4  # a refused call changes nothing
    with pytest.raises(ValueError, match="4 aux rows and 3 next tokens"):
        propose_one(drafter, "r", 0, aux, tokens[:3], 2)
    with pytest.raises(ValueError, match="1 rids, 1 steps, 2 ks"):
        drafter.propose(["r"], [HeadStep(0, aux, tokens)], [1, 1])
    with pytest.raises(ValueError, match="no new position"):
        propose_one(drafter, "r", 0, aux[:0], [], 2)
    with pytest.raises(ValueError, match="already added"):
        drafter.add("r")
    drafter.remove("r")
    assert drafter.requests() == ["s"]
