"""The scheduler's parts on their own: the step token budget, draft caps, block victims."""

from __future__ import annotations

from pipeline.engine.blocks import BlockBudget
from pipeline.engine.decode import fit_caps
from pipeline.engine.prefill import TokenBudget, continuing_chunks
from pipeline.engine.request import EngineRequest
from pipeline.params import SamplingParams


def running(rid: str, seq: int, prompt: int, output: int = 0, computed: int | None = None
            ) -> EngineRequest:
    req = EngineRequest(rid, [1] * prompt, SamplingParams(max_new_tokens=64), seq=seq,
                        num_output=output, output_ids=[2] * output)
    req.prefill_len = prompt + output
    req.computed = req.prefill_len if computed is None else computed
    req.reserved = req.prefill_len
    return req


def test_a_token_budget_hands_out_what_is_left_and_none_is_unbounded():
    budget = TokenBudget.after_verifies(10, [2, 0])  # rows of 3 and 1 tokens
    assert (budget.take(4), budget.take(4), budget.spent) == (4, 2, True)
    assert budget.take(5) == 0
    assert TokenBudget.after_verifies(3, [4]).left == 0
    free = TokenBudget.after_verifies(None, [4])
    assert (free.take(1000), free.spent) == (1000, False)


def test_prefills_under_way_continue_oldest_first_until_the_budget_is_spent():
    old, young = running("old", 1, 20, computed=5), running("young", 2, 30, computed=0)
    done = running("done", 0, 10)
    chunks = continuing_chunks([young, done, old], TokenBudget(20))
    assert [(c.req.rid, c.start, c.end) for c in chunks] == [("old", 5, 20), ("young", 0, 5)]


def test_caps_shrink_largest_first_until_the_rows_fit():
    caps = {"a": 4, "b": 2, "c": 4}
    fit_caps(caps, 10)  # 3 rows + 10 drafts = 13 tokens: three drafts go
    assert caps == {"a": 2, "b": 2, "c": 3}  # ties: the first row
    fit_caps(caps, 1)  # rows alone over the budget: every cap goes to 0, the rows stay
    assert caps == {"a": 0, "b": 0, "c": 0}


def test_the_newest_verifying_requests_are_the_victims_until_the_rest_fit():
    blocks = BlockBudget(num_blocks=6, block_size=4, max_model_len=64, num_speculative_tokens=3)
    reqs = {r.rid: r for r in [running("a", 0, 7, 1), running("b", 1, 7, 1),
                               running("c", 2, 7, 1), running("p", 3, 3, computed=0)]}
    caps = {"a": 3, "b": 3, "c": 3}  # each verify needs 3 blocks, the prefill 1
    assert [r.rid for r in blocks.victims(reqs, caps)] == ["c", "b"]
    # without drafts each verify needs 2 blocks: 3 x 2 + 1 = 7, one over
    assert [r.rid for r in blocks.victims(reqs, {"a": 0, "b": 0, "c": 0})] == ["c"]
    assert BlockBudget(None, 4, 64, 3).victims(reqs, caps) == []  # no pool: nobody
