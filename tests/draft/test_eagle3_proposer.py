"""Eagle3Proposer between plans: each plan's states become one HeadStep per request with the
tokens after them; states whose next token is not known yet wait; a request whose states were
never sent (a replaced draft stage) drafts nothing instead of failing; a request not drafting
this step is still fed."""

from __future__ import annotations

import pytest
import torch
from support.eagle3_heads import tiny_target_config, write_layout

from pipeline.draft.eagle3 import HeadStep, load_eagle3_head
from pipeline.draft.eagle3.proposer import Eagle3Proposer
from pipeline.draft.step import draft_step
from pipeline.models.tiny import tiny_model
from pipeline.params import SamplingParams
from pipeline.protocol import HiddenStates, NewRequest, StepPlan

TARGET = tiny_target_config()
AUX = 3 * TARGET.hidden_size
GREEDY = SamplingParams(max_new_tokens=8)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    folder = write_layout(tmp_path_factory.mktemp("head"), "eagle", TARGET, seed=2)
    return load_eagle3_head(str(folder), TARGET, tiny_model(TARGET).embed.weight.detach())


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, AUX, generator=torch.Generator().manual_seed(seed))


def recording(head) -> tuple[Eagle3Proposer, list]:
    proposer, fed = Eagle3Proposer(head), []
    feed = proposer.drafter.propose

    def record(rids, steps, ks):
        fed.append([(r, s.start, s.next_tokens, k) for r, s, k in zip(rids, steps, ks)])
        return feed(rids, steps, ks)

    proposer.drafter.propose = record
    return proposer, fed


def test_a_prefill_then_a_verify_feed_each_position_with_the_token_after_it(head):
    proposer, fed = recording(head)
    prompt = [5, 6, 7, 8]
    draft_step(proposer, StepPlan(0, new=[NewRequest("a", prompt, GREEDY)]))
    prefill = HiddenStates(["a"], [0], [4], rows(4, 0))
    p = draft_step(proposer, StepPlan(1, decode=["a"], last_tokens=[9], kv_lens=[4],
                                      num_outputs=[1], ks=[3], commits={"a": [9]},
                                      hidden=prefill))
    assert fed[-1] == [("a", 0, [6, 7, 8, 9], 3)]
    assert len(p.tokens[0]) == 3 and len(p.confidence[0]) == 3
    # the verify kept position 4 (token 9) and one accepted draft (10); 11 is the bonus
    kept = HiddenStates(["a"], [4], [2], rows(2, 1))
    draft_step(proposer, StepPlan(2, decode=["a"], last_tokens=[11], kv_lens=[6],
                                  num_outputs=[3], ks=[2], commits={"a": [10, 11]}, hidden=kept))
    assert fed[-1] == [("a", 4, [10, 11], 2)]
    assert proposer.drafter.length("a") == 6


def test_a_chunk_is_fed_without_drafting_and_waits_for_nothing(head):
    proposer, fed = recording(head)
    prompt = list(range(10, 20))
    draft_step(proposer, StepPlan(0, new=[NewRequest("a", prompt, GREEDY, chunk=4)]))
    draft_step(proposer, StepPlan(1, prefills=["a"], prefill_starts=[4], prefill_ends=[10],
                                  hidden=HiddenStates(["a"], [0], [4], rows(4, 2))))
    assert fed[-1] == [("a", 0, [11, 12, 13, 14], 0)]


def test_states_before_their_next_token_is_known_wait(head):
    proposer = Eagle3Proposer(head)
    proposer.add("a", [1, 2, 3], GREEDY)
    proposer.hidden_states(HiddenStates(["a"], [0], [3], rows(3, 3)))
    step = proposer._step("a")  # the token after position 2 is not committed yet
    assert (step.start, step.next_tokens) == (0, [2, 3])
    proposer.drafter.propose(["a"], [step], [0])
    proposer.commit("a", [4])
    step = proposer._step("a")
    assert (step.start, step.next_tokens) == (2, [4])


def test_missing_states_leave_a_request_undrafted_not_failed(head):
    proposer = Eagle3Proposer(head)
    proposer.add("a", [1, 2, 3], GREEDY)
    proposer.commit("a", [4, 5])
    proposer.hidden_states(HiddenStates(["a", "gone"], [3, 0], [1, 1], rows(2, 4)))
    assert proposer.propose(["a"], [4]).tokens == [[]]
    proposer.hidden_states(HiddenStates(["a"], [4], [1], rows(1, 5)))
    assert proposer.propose(["a"], [4]).tokens == [[]]  # blind for good: still a gap


def test_drafts_equal_the_drafter_fed_the_same_steps(head):
    from pipeline.draft.eagle3 import Eagle3Drafter

    proposer = Eagle3Proposer(head)
    proposer.add("a", [1, 2, 3], GREEDY)
    proposer.commit("a", [4])
    aux = rows(3, 6)
    proposer.hidden_states(HiddenStates(["a"], [0], [3], aux))
    got = proposer.propose(["a"], [3])
    drafter = Eagle3Drafter(head)
    drafter.add("a")
    want = drafter.propose(["a"], [HeadStep(0, aux, [2, 3, 4])], [3])
    assert got.tokens == want.tokens and got.probs is None
    assert got.confidence[0] == pytest.approx(torch.tensor(want.probs[0]).cumprod(0).tolist())
