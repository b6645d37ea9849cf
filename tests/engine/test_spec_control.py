"""Adaptive speculation's choice of k (pipeline.engine.spec), with literal expectations."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import load_config
from pipeline.engine.spec.cost import CostModel, StepCosts
from pipeline.engine.spec.estimate import Acceptance
from pipeline.engine.spec.plan import drain_plan, gains, rate_plan
from pipeline.engine.spec.policy import EXPLORE_K, SpecController
from pipeline.engine.spec.record import span_attributes
from pipeline.spec_settings import SpecSettings


def controller(mode: str = "adaptive", num_speculative_tokens: int = 4, **kw) -> SpecController:
    """A controller that verifies every draft that pays at all (margin 1) unless told."""
    kw.setdefault("margin", 1.0)
    return SpecController(SpecSettings(mode, num_speculative_tokens, **kw))


def trained(c: SpecController, base: float, per_row: float, steps: int = 150) -> None:
    """Feed every batch class's cost model exact linear step times over varied row counts."""
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for i in range(steps):
            rows = batch + i % 9
            c.cost.observe(batch, rows, 0, base + per_row * rows)


def test_acceptance_is_a_plain_mean_then_an_ema_only_at_positions_the_verifier_saw():
    a = Acceptance.empty(4)
    a.update(drafted=4, accepted=1, alpha=0.25)  # position 0 accepted, 1 rejected, 2-3 unseen
    assert (a.mean, a.seen) == ([1.0, 0.0, 0.0, 0.0], [1, 1, 0, 0])
    for accepted in (1, 0, 0):  # one-draft steps: position 0 only
        a.update(drafted=1, accepted=accepted, alpha=0.25)
    assert a.mean[0] == 0.5 and a.seen == [4, 1, 0, 0]  # the mean of 1, 1, 0, 0
    a.update(drafted=1, accepted=0, alpha=0.25)  # the fifth: weight 0.25, not 1/5
    assert a.mean[0] == 0.375


def test_the_estimate_blends_the_prior_with_own_evidence():
    a = Acceptance([1.0, 0.0, 0.0, 0.0], [2, 1, 0, 0])
    # (2 * 0.9 + 2 * 1) / 4, (2 * 0.6 + 0) / 3, then the prior where nothing was seen
    assert a.estimate([0.9, 0.6, 0.3, 0.2], prior_weight=2.0) == \
        pytest.approx([0.95, 0.4, 0.3, 0.2])
    # carried (the pool): position 1's prior is max(0.5, 0.75), so (2 * 0.75) / 3, ...
    assert a.estimate([0.5] * 4, prior_weight=2.0, carry=True) == [0.75, 0.5, 0.5, 0.5]
    copy = Acceptance([1.0, 1.0, 0.0, 0.0], [6, 6, 0, 0])
    assert copy.estimate([0.5] * 4, 2.0, carry=True) == [0.875, 0.96875, 0.96875, 0.96875]
    assert gains([0.875, 0.25, 0.5], 3) == [0.875, 0.21875, 0.109375]


def test_fixed_mode_takes_every_draft_the_caps_allow():
    c = controller("fixed", 4)
    assert c.choose(["a", "b", "c"], [9, 2, 0]) == [4, 2, 0]


def test_the_first_step_is_plain_until_a_step_cost_is_measured():
    c = controller()
    assert c.choose(["a", "b"], [4, 4]) == [0, 0]


def test_the_cost_model_recovers_a_linear_step_time():
    m = CostModel(decay=0.97)
    for i in range(200):
        rows, longest = 1 + i % 7, i % 3
        m.observe(rows, longest, 0.05 + 0.01 * rows + 0.002 * longest)
    base, per_row, per_draft, per_verify = m.coefficients(0)
    assert (base, per_row, per_draft) == pytest.approx((0.05, 0.01, 0.002), abs=1e-4)
    assert per_verify == pytest.approx(0.0, abs=1e-4)


def test_each_batch_class_learns_its_own_step_cost():
    costs = StepCosts(decay=0.97)
    for i in range(200):  # batch 8 (class 8-15): rows are costly
        costs.observe(8, 8 + i % 9, 0, 0.05 + 0.01 * (8 + i % 9))
    assert costs.known(12) and not costs.known(1) and not costs.known(16)
    for i in range(200):  # batch 1: a row costs a tenth of that
        costs.observe(1, 1 + i % 5, i % 5, 0.05 + 0.001 * (1 + i % 5) + 0.0005 * (i % 5))
    base, per_row, per_draft, _ = costs.coefficients(1)
    # at batch 1 rows and the longest draft move together: only their sum is identified
    assert base == pytest.approx(0.051, abs=2e-4) and per_row + per_draft == pytest.approx(
        0.0015, abs=2e-4)
    assert costs.coefficients(8)[1] == pytest.approx(0.01, abs=5e-4)  # batch 1 left it alone


def _batch1_costs(c: SpecController) -> None:
    """SmolLM2 at batch 1 on one CPU thread: a plain decode 60 ms; verifying any draft adds
    40 ms (two rows leave the matrix-vector kernels), then 2.5 ms a draft."""
    for i in range(300):
        k = i % 9
        c.cost.observe(1, 1 + k, k, 0.06 + (0.04 + 0.0025 * k if k else 0.0))


def _teach_pool(c: SpecController, kept: list[int]) -> None:
    """The pool learns position-0 outcomes (1 kept, 0 not), over and over, each a request's
    first draft (of requests already gone: no run state)."""
    for i in range(40):
        for j, n in enumerate(kept):
            c.observe([f"w{i}-{j}"], [1], [1 + n], None)


def test_the_fixed_cost_of_verifying_any_draft_is_learned_apart_from_the_rows():
    c = controller(num_speculative_tokens=8, probe_every=1000)
    _batch1_costs(c)
    base, per_row, per_draft, per_verify = c.cost.coefficients(1)
    assert base == pytest.approx(0.06, abs=1e-3)
    assert per_verify == pytest.approx(0.04, abs=1e-3)
    assert per_row + per_draft == pytest.approx(0.0025, abs=2e-4)


def test_a_draft_that_cannot_pay_for_the_verify_step_is_not_verified_at_batch_1():
    # p = 0.4 a position: 1 draft yields 1.4 tokens in 102.5 ms, 3 drafts 1.62 in 107.5, 8
    # drafts 1.67 in 120, a plain decode 1 in 60 (16.7 tokens/s against at best 15.1). A line
    # through the step times prices a 1-draft step far below its 102.5 ms and drafts.
    c = controller(num_speculative_tokens=8, probe_every=1000)
    _batch1_costs(c)
    _teach_pool(c, [1, 0, 1, 0, 0])
    assert c.pooled()[0] == pytest.approx(0.4, abs=0.05)
    assert c.choose(["r"], [8]) == [0]
    # copied text (p = 0.9): the fixed cost is shared by many kept drafts, so draft them all
    c2 = controller(num_speculative_tokens=8, probe_every=1000)
    _batch1_costs(c2)
    _teach_pool(c2, [1] * 9 + [0])
    assert c2.choose(["r"], [8]) == [8]


def test_a_new_batch_class_starts_from_the_nearest_known_class_slopes():
    # batch 32 on CPU: a plain step of 32 rows takes 0.44 s, a verify row ~3 ms; its plain steps
    # alone cannot tell what a row costs, so a prior of a tenth of the base (~10 ms a row) would
    # keep every draft out, and no verified row would ever correct it
    costs = StepCosts(decay=0.97)
    for i in range(200):
        costs.observe(8, 8 + i % 9, i % 3, 0.3 + 0.003 * (8 + i % 9) + 0.004 * (i % 3))
    costs.observe(1, 1, 0, 0.06)  # batch 1 is farther from 32 than batch 8 is
    costs.observe(32, 32, 0, 0.44)
    base, per_row, per_draft, _ = costs.coefficients(32)
    assert (per_row, per_draft) == pytest.approx(costs.coefficients(8)[1:3])
    assert (per_row, per_draft) == pytest.approx((0.003, 0.004), rel=0.1)  # not 0.01 a row
    assert base == pytest.approx(0.44, rel=0.01)  # the plain step it measured


def test_a_class_whose_rows_only_the_prior_priced_drafts_every_cap_once_then_plans():
    # copy at batch 32 after a warm-up at batch 2, where a row costs 20 ms: the new class takes
    # that slope, no draft (not even a sure one) pays at it, and plain steps never correct it
    # (copy drafted nothing while fixed k = 2 ran faster). Its rows really cost 3 ms.
    c = controller(probe_every=8, margin=1.5)
    for i in range(40):
        rows = 2 + i % 5
        c.cost.observe(2, rows, min(i % 5, 4), 0.06 + 0.02 * rows)
    c.choose(["w"], [4])
    for _ in range(60):  # the pool learned copies
        c.observe(["w"], [4], [5], None)
    c.forget("w")
    rids = [f"r{i}" for i in range(32)]
    drafts, floors = [], []
    for _ in range(10):
        ks = c.choose(rids, [4] * 32)
        drafts.append(sum(ks))
        floors.append(c.min_gains(rids))
        c.observe(rids, ks, [k + 1 for k in ks], 0.34 + 0.003 * (32 + sum(ks)) + 0.004 * max(ks))
    assert drafts[0] == 0  # the class's first step: nothing measured at batch 32
    assert drafts[1] == 32 * 4 and floors[1] == [0.0] * 32  # every draft, to measure the rows
    assert c.cost.rows_measured(32) and c.cost.coefficients(32)[1] < 0.005
    assert all(d > 0 for d in drafts[2:])  # copies draft on the plan, not as probes
    assert all(f > 0 for f in floors[2])


def test_once_a_class_measured_its_rows_the_prior_steps_back():
    # copy at batch 32 (SmolLM2, CPU): seeded with batch 2's 11.7 ms a row, a plain step of
    # 443 ms, then every request drafting 8: 288 rows in 855 ms (1.6 ms a row)
    m = CostModel(prior_slopes=(0.0117, 0.0, 0.0))
    m.observe(32, 0, 0.443)
    assert not m.rows_measured
    m.observe(288, 8, 0.855, verified=256 / 32)
    base, per_row, per_draft, per_verify = m.coefficients(32)
    assert m.rows_measured
    assert per_row * 256 + per_draft * 8 + per_verify == pytest.approx(0.855 - 0.443, rel=0.15)
    assert base == pytest.approx(0.443, rel=0.1)


def test_measuring_a_class_costs_about_prior_weight_batches_of_rows():
    # chat: a quarter of the requests have a draft at a time, none is kept; the class drafts
    # every cap until ~2 batches of extra rows were verified, then only probes (one draft)
    c = controller(probe_every=8, margin=1.5)
    rids = [f"r{i}" for i in range(8)]
    drafts, longest = [], []
    for step in range(30):
        caps = [4 if (step + i) % 4 == 0 else 0 for i in range(8)]
        ks = c.choose(rids, caps)
        drafts.append(sum(ks))
        longest.append(max(ks))
        c.observe(rids, ks, [1] * 8, 0.1 + 0.03 * (8 + sum(ks)))
    assert drafts[:4] == [0, 8, 8, 0], drafts  # plain (nothing measured), every cap twice
    assert c.cost.rows_measured(8)
    assert max(longest[3:]) == 1 and sum(drafts[3:]) < sum(drafts[:3]), drafts  # probes only


def test_cheap_rows_and_good_acceptance_draft_the_most():
    c = controller()
    trained(c, base=0.05, per_row=0.001)
    c.choose(["a"], [4])  # its state starts at its first step
    for _ in range(20):
        c.observe(["a"], [4], [5], None)  # everything accepted
    assert c.choose(["a"], [4]) == [4]


def test_a_request_that_never_gets_a_draft_accepted_gets_none():
    c = controller()
    trained(c, base=0.05, per_row=0.01)
    c.choose(["a"], [4])  # its state starts at its first step
    for _ in range(20):
        c.observe(["a"], [4], [1], None)  # first position always rejected
    assert c.choose(["a"], [4]) == [0]


def test_expensive_rows_at_a_large_batch_keep_only_the_likely_drafts():
    # Plain decode of 8 rows: 0.05 + 8 * 0.01 = 0.13 s for 8 tokens (61.5 tokens/s). One more row
    # costs 0.01 s, so a draft pays only if its expected gain beats 0.615 tokens.
    c = controller()
    trained(c, base=0.05, per_row=0.01)
    rids = [f"r{i}" for i in range(8)]
    good, bad = rids[:2], rids[2:]
    c.choose(rids, [4] * 8)  # a request's state starts at its first step
    for _ in range(30):
        c.observe(good, [4, 4], [5, 5], None)
        c.observe(bad, [1] * 6, [1] * 6, None)
    ks = c.choose(rids, [4] * 8)
    assert ks[2:] == [0] * 6
    assert ks[:2] == [4, 4]


def test_a_request_left_at_zero_is_probed_with_one_draft():
    c = controller(probe_every=3)
    trained(c, base=0.05, per_row=0.01)
    c.choose(["a"], [4])  # its state starts at its first step
    for _ in range(20):
        c.observe(["a"], [4], [1], None)
    ks = []
    for _ in range(8):  # each step's drafts are verified and rejected
        ks.append(c.choose(["a"], [4])[0])
        c.observe(["a"], ks[-1:], [1], None)
    assert ks[:4] == [0, 0, 0, 1]  # after 3 steps without a verified draft


def test_a_probe_the_proposer_had_no_draft_for_waits_its_interval_again():
    # chat: a due request probes at its next stray n-gram match, alone in its step, unless a
    # probe without a draft counts as made
    c = controller(probe_every=3)
    trained(c, base=0.05, per_row=0.01)
    c.choose(["a"], [4])
    for _ in range(20):
        c.observe(["a"], [4], [1], None)
    ks = []
    for _ in range(12):  # the proposer never has a draft
        ks.append(c.choose(["a"], [4])[0])
        c.observe(["a"], [0], [1], None)
    assert ks == [0, 0, 0, 1] * 3


def test_a_rejected_probe_doubles_the_wait_and_an_accepted_draft_resets_it():
    c = controller(probe_every=2, probe_backoff=4)
    trained(c, base=0.05, per_row=0.01)
    c.choose(["a"], [4])
    for _ in range(20):
        c.observe(["a"], [4], [1], None)

    def steps(n: int, accept: int) -> list[int]:  # the first `accept` drafted steps keep 1
        ks = []
        for _ in range(n):
            ks.append(c.choose(["a"], [4])[0])
            kept = ks[-1] > 0 and accept > 0
            accept -= kept
            c.observe(["a"], ks[-1:], [1 + kept], None)
        return ks

    def gaps(ks: list[int]) -> list[int]:  # steps at 0 before each drafted step
        return [len(run) for run in "".join("1" if k else "0" for k in ks).split("1")[:-1]]

    # waits 2, 4, 8, then capped at 2 * 4
    assert gaps(steps(30, accept=0)) == [2, 4, 8, 8]
    # a probe that keeps its draft (after the capped wait's rest) brings the wait back to
    # probe_every: once the drafts it earned are rejected, the probes come after 2, 4, 8, 8
    after = gaps(steps(40, accept=1))
    assert after[0] == 4 and after[-4:] == [2, 4, 8, 8]


def test_caps_are_respected_and_forget_resets_a_request():
    c = controller()
    trained(c, base=0.05, per_row=0.0001)
    c.choose(["a"], [4])  # its state starts at its first step
    for _ in range(20):
        c.observe(["a"], [4], [5], None)
    assert c.choose(["a"], [2]) == [2]
    c.forget("a")
    assert c.tracked == 0
    assert c.estimate("a") == c.pooled()


def test_a_new_request_starts_from_the_pooled_acceptance_of_earlier_requests():
    fresh = controller()
    trained(fresh, base=0.05, per_row=0.01)
    assert fresh.pooled() == [0.5] * 4
    assert fresh.choose(["new"], [4]) == [2]  # 0.5, 0.25, ... : two drafts pay at batch 1
    copy = controller()
    trained(copy, base=0.05, per_row=0.01)
    for _ in range(10):
        copy.observe(["a"], [4], [5], None)  # earlier requests: everything accepted
    # ten observations, each step's fading by 1 - pool_alpha: n = 1 + 0.95 + ... + 0.95^9
    n = sum(0.95 ** j for j in range(10))
    expected, before = [], 0.0
    for _ in range(4):  # the prior carried: max(0.5, the position before)
        before = (2 * max(0.5, before) + n * 1.0) / (2 + n)
        expected.append(before)
    assert copy.pooled() == pytest.approx(expected, abs=1e-9)
    assert expected[0] == pytest.approx(0.9003, abs=1e-4)
    assert copy.choose(["new"], [4]) == [4]  # a long k from its very first step
    chat = controller()
    trained(chat, base=0.05, per_row=0.01)
    for _ in range(10):
        chat.observe(["a"], [4], [1], None)  # earlier requests: nothing accepted
    assert chat.pooled() == pytest.approx([2 * 0.5 / (2 + n), 0.5, 0.5, 0.5])  # ~0.10
    assert chat.choose(["new"], [4]) == [0]


def test_own_evidence_overrides_the_pool():
    c = controller()
    trained(c, base=0.05, per_row=0.01)
    for _ in range(10):
        c.observe(["a"], [4], [5], None)
    c.choose(["x"], [4])
    for _ in range(6):
        c.observe(["x"], [1], [1], None)  # x's first draft always rejected
    # (2 * pooled[0] + 6 * 0) / 8, pooled[0] itself pulled down a little by x's rejections
    assert c.estimate("x")[0] == pytest.approx(2 * c.pooled()[0] / 8)
    assert c.choose(["x"], [4]) == [0]


def test_a_request_finished_before_its_step_is_observed_leaves_no_state_behind():
    c = controller()
    trained(c, base=0.05, per_row=0.01)
    c.choose(["a"], [4])
    c.forget("a")  # its finish notice arrived while the step ran (overlap)
    c.observe(["a"], [4], [3], 0.1)
    assert c.tracked == 0
    assert c.pool.seen == [1, 1, 1, 0]  # the pool still learned from it


@pytest.mark.parametrize("field,value", [("speculation", "always"), ("spec_ema_alpha", 0),
                                          ("spec_prior", 1.5), ("spec_probe_every", 0),
                                          ("spec_probe_backoff", 0), ("spec_cost_decay", "x"), ("spec_margin", 0.9),
                                          ("spec_margin", True)])
def test_bad_speculation_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        load_config("configs/tiny.yaml", {field: value})


def test_a_pinned_request_gets_its_cap_whatever_its_acceptance():
    c = controller()
    trained(c, base=0.05, per_row=0.01)
    c.choose(["a", "b"], [4, 4])
    for _ in range(20):
        c.observe(["a", "b"], [4, 4], [1, 1], None)
    assert c.choose(["a", "b"], [4, 3], pinned=[False, True]) == [0, 3]


def test_at_batch_8_with_costly_rows_the_pool_decides_a_new_requests_first_k():
    # A plain step of 8 rows: 0.04 + 8 * 0.01 = 0.12 s (66.7 tokens/s); a verify row costs
    # 0.01 s, so a draft pays only if its expected gain beats 0.667 tokens.
    def at_batch_8(earlier_tokens: int) -> list[int]:
        c = controller()
        trained(c, base=0.04, per_row=0.01)
        old, new = [f"o{i}" for i in range(8)], [f"n{i}" for i in range(8)]
        if earlier_tokens:
            c.choose(old, [4] * 8)
            for _ in range(5):
                c.observe(old, [4] * 8, [earlier_tokens] * 8, None)
            for rid in old:
                c.forget(rid)
        return c.choose(new, [4] * 8)

    assert at_batch_8(0) == [0] * 8  # nothing known: the 0.5 prior does not pay here
    assert at_batch_8(5) == [4] * 8  # after copy text: every draft from the first step
    assert at_batch_8(2) == [1] * 8  # position 0 always kept, position 1 never


# --- scored drafts: the floor the draft stage keeps drafts above ----------------------------
def test_the_floor_is_the_break_even_gain_of_a_verify_row():
    # b = 8, plain step 0.05 + 8 * 0.01 = 0.13 s (61.5 tokens/s) and no draft pays (the pool's
    # prior 0.5 < 0.615), so a verify row must bring 61.5 * 0.01 = 0.615 tokens.
    c = controller()
    rids = [f"r{i}" for i in range(8)]
    assert c.min_gains(rids) == [math.inf] * 8  # nothing measured: no draft pays
    trained(c, base=0.05, per_row=0.01)
    assert c.choose(rids, [4] * 8) == [0] * 8
    # (the fit still carries a little of its first-step prior)
    assert c.min_gains(rids) == pytest.approx([0.13 ** -1 * 8 * 0.01] * 8, rel=0.05)


def test_a_probe_trusts_the_proposers_own_scores_once():
    # a request whose scored drafts all failed: its calibration puts its floor out of reach, so
    # nothing of it is verified and the calibration could never recover without a probe
    c = controller(probe_every=2)
    trained(c, base=0.05, per_row=0.01)
    c.choose(["a"], [4])
    for _ in range(30):
        c.observe(["a"], [4], [1], None, expected=[3.0])
    floors = []
    for _ in range(3):  # nothing verified for 2 steps: the third step probes
        c.choose(["a"], [4])
        floors.append(c.min_gains(["a"])[0])
        c.observe(["a"], [0], [1], None)
    assert floors[0] > 1.0 and floors[1] > 1.0  # no confidence reaches it
    assert floors[2] == pytest.approx(c.floor) and floors[2] < 1.0


def test_fixed_mode_and_pinned_requests_keep_every_scored_draft():
    assert controller("fixed").min_gains(["a", "b"]) == [0.0, 0.0]
    c = controller()
    trained(c, base=0.05, per_row=0.01)
    c.choose(["a", "b"], [4, 4], pinned=[True, False])
    gains_ = c.min_gains(["a", "b"], pinned=[True, False])
    assert gains_[0] == 0.0 and gains_[1] > 0.0


def test_a_request_whose_scored_drafts_fail_needs_more_confidence_than_one_whose_succeed():
    c = controller()
    trained(c, base=0.05, per_row=0.01)
    c.choose(["good", "bad"], [4, 4])
    for _ in range(10):  # both were told 3.6 tokens would be accepted of 4 drafts
        c.observe(["good", "bad"], [4, 4], [5, 1], None, expected=[3.6, 3.6])
    c.choose(["good", "bad"], [4, 4])
    good, bad = c.min_gains(["good", "bad"])
    assert good < c.floor < bad  # good: calibration > 1 (4 of 3.6); bad: far below 1
    assert bad > 1.0  # nothing a proposer can score (confidence <= 1) is verified for it
    # the pool learned too: a new request starts less trusting than the prior (1.0)
    c.choose(["new"], [4])
    assert c.min_gains(["new"])[0] > c.floor


def test_the_margin_drops_drafts_that_pay_only_a_little():
    # b = 8 at 61.5 tokens/s plain: a draft pays from 0.615 expected tokens (one row, 0.01 s);
    # with margin 1.5 (1 + 0.5 * 7/8 at batch 8) it must bring 0.88. r0's first draft is always
    # accepted, r1's 3 times in 4, the others' never.
    rids = [f"r{i}" for i in range(8)]
    ks = {}
    for margin in (1.0, 1.5):
        c = controller(margin=margin, num_speculative_tokens=1)
        trained(c, base=0.05, per_row=0.01)
        c.choose(rids, [1] * 8)
        for t in range(40):
            c.observe(rids, [1] * 8, [2, 1 if t % 4 == 0 else 2] + [1] * 6, None)
        assert 0.7 < c.estimate("r1")[0] < 0.9 and c.estimate("r0")[0] > 0.95
        ks[margin] = c.choose(rids, [1] * 8)
    assert ks[1.0] == [1, 1] + [0] * 6
    assert ks[1.5] == [1, 0] + [0] * 6


def test_a_copy_request_among_long_chats_keeps_its_drafts():
    # every request's tokens count alike: a copy that finishes sooner frees its slot for the next
    c = controller()
    trained(c, base=0.05, per_row=0.01)
    rids = [f"r{i}" for i in range(8)]
    c.choose(rids, [4] * 8)
    for _ in range(30):  # r0, r1 copy (every draft accepted), the rest never
        c.observe(rids[:2], [4, 4], [5, 5], None)
        c.observe(rids[2:], [1] * 6, [1] * 6, None)
    assert c.choose(rids, [4] * 8) == [4, 4] + [0] * 6


def test_no_probe_where_even_a_sure_draft_would_not_pay():
    c = controller(probe_every=2, margin=1.5)
    trained(c, base=0.0, per_row=0.01)  # a row costs a plain row's time: no draft pays 1.5x
    rids = [f"r{i}" for i in range(8)]
    c.choose(rids, [4] * 8)
    assert c.floor > 1.0
    assert all(c.choose(rids, [4] * 8) == [0] * 8 for _ in range(6))


def test_at_batch_1_the_margin_does_not_apply():
    # 20 tokens/s plain (0.05 s); a draft costs 0.01 s: it pays from 0.2 expected tokens, at
    # batch 1 whatever the margin (no other request waits on its row; margin 5 would ask 1.0)
    ks = []
    for margin in (1.0, 5.0):
        c = controller(margin=margin, num_speculative_tokens=1)
        trained(c, base=0.04, per_row=0.01)
        c.choose(["a"], [1])
        for t in range(40):
            c.observe(["a"], [1], [1 + (t % 4 < 2)], None)  # half, whatever the last step
        assert 0.3 < c.estimate("a")[0] < 0.7
        ks.append(c.choose(["a"], [1]))
    assert ks == [[1], [1]]


def test_inside_a_run_and_at_its_edge_are_estimated_apart():
    # Copy-like text: runs of fully accepted drafts between stretches where the first draft is
    # rejected. One average would draft alike everywhere; the two states draft long inside a
    # run and little at its edge.
    c = controller(num_speculative_tokens=4)
    trained(c, base=0.05, per_row=0.03)
    c.choose(["a"], [4])  # its state starts at its first step
    for _ in range(6):
        for outcome in [1] * 4 + [5] * 6:  # 4 steps with the first draft rejected, a run of 6
            c.observe(["a"], [4], [outcome], None)
    inside = c.estimate("a")[0]
    assert inside > 0.75
    assert c.choose(["a"], [4]) == [4]
    c.observe(["a"], [4], [1], None)  # the run ends: now at its edge
    edge = c.estimate("a")[0]
    assert edge < 0.5
    assert c.choose(["a"], [4]) == [0]
    c.forget("a")
    assert c.estimate("a") == c.pooled()


def test_a_probe_kept_whole_does_not_start_a_run():
    # The in-run pool learned on copied text says "draft long"; a chat request whose lone probe
    # happens to match must not draft that long on the strength of one token.
    c = controller(num_speculative_tokens=4, probe_every=2)
    trained(c, base=0.05, per_row=0.01)
    c.choose(["copy"], [4])
    for _ in range(20):  # copied text: every draft kept, then a run of them
        c.observe(["copy"], [4], [5], None)
    assert c.pooled(run=True)[0] > 0.9
    c.choose(["chat"], [4])
    for _ in range(20):  # chat: drafts rejected until the request sits at k = 0
        c.observe(["chat"], [1], [1], None)
    ks = [c.choose(["chat"], [4])[0]]
    while ks[-1] == 0:
        c.observe(["chat"], [0], [1], None)
        ks.append(c.choose(["chat"], [4])[0])
    assert ks[-1] == 1  # the probe
    c.observe(["chat"], [1], [2], None)  # kept
    # still estimated from its own (cold) history, not the copies' in-run pool
    assert c.estimate("chat")[0] < 0.5
    assert c.choose(["chat"], [4])[0] < 4
    c.observe(["chat"], [1], [2], None)  # a planned draft kept whole: now a run
    assert c.estimate("chat")[0] > 0.5


def test_the_pools_forget_positions_nobody_drafted_lately():
    # Copies fill the pools with ~1.0 at every position; chat requests then rarely reach a deep
    # position or a run, so unfaded those ~1.0 would stand for ever and a chat request entering
    # a run would draft the copies' length. Faded each step, evidence not renewed falls back
    # towards the carried prior; evidence renewed each step keeps its weight.
    c = controller(num_speculative_tokens=8)
    trained(c, base=0.05, per_row=0.01)
    for i in range(30):  # copies: every draft kept, in a run after the first step
        c.choose([f"copy{i}"], [8])
        for _ in range(5):
            c.observe([f"copy{i}"], [8], [9], None)
        c.forget(f"copy{i}")
    # in-run: renewed every step (n ~ 1 / pool_alpha = 20); cold: a copy's first step only
    assert min(c.pooled(run=True)) > 0.9 and min(c.pooled()) > 0.8
    for i in range(200):  # chat: a first draft kept half the time, never two in a row
        c.choose([f"chat{i}"], [8])
        c.observe([f"chat{i}"], [2], [1 + i % 2], None)
        c.forget(f"chat{i}")
    cold, hot = c.pooled(), c.pooled(run=True)
    assert cold[0] == pytest.approx(0.5, abs=0.05)  # renewed every step: the chat rate
    assert cold[1] < 0.1  # renewed: the second draft never kept
    assert hot == pytest.approx([0.5] * 8, abs=0.01)  # no run for 200 steps: the prior again
    # a step's fade applies once, whatever the batch, and only in a step that verified a draft
    d = controller(num_speculative_tokens=2)
    d.observe(["a", "b", "c"], [1, 1, 1], [2, 2, 2], None)
    d.observe(["a"], [0], [1], None)
    assert d.pool.seen == pytest.approx([3.0, 0.0])
    d.observe(["a", "b"], [0, 1], [1, 1], None)
    assert d.pool.seen == pytest.approx([3 * 0.95 + 1, 0.0])


def test_plain_steps_between_copies_leave_the_pools_as_they_were():
    # Mix at batch 1: a chat request decodes ~60 plain steps between two copies. Those steps
    # verify nothing and say nothing about any position; faded per step, the copies' in-run
    # evidence fell back to the prior and the next copy started its runs short.
    c = controller(num_speculative_tokens=8)
    trained(c, base=0.05, per_row=0.01)
    c.choose(["copy"], [8])
    for _ in range(20):
        c.observe(["copy"], [8], [9], None)
    c.forget("copy")
    before = c.pooled(run=True)
    assert min(before) > 0.9
    c.choose(["chat"], [8])
    for _ in range(60):
        c.observe(["chat"], [0], [1], None)
    assert c.pooled(run=True) == pytest.approx(before)


def test_in_a_drain_a_request_sure_to_finish_before_another_drafts_nothing():
    # A wave of a copy and a chat request at batch 2, nothing waiting: the chat decodes a token
    # a step, so the wave lasts its 64 steps whatever the copy does; the copy's drafts would
    # only slow those steps.
    def state() -> SpecController:
        c = controller()
        trained(c, base=0.05, per_row=0.002)
        c.choose(["copy", "chat"], [4, 4])
        for _ in range(10):
            c.observe(["copy", "chat"], [4, 1], [5, 1], None)
        return c

    assert state().choose(["copy", "chat"], [4, 4])[0] == 4  # requests may still arrive
    assert state().choose(["copy", "chat"], [4, 4], remaining=[64, 64])[0] == 0
    # a copy with more left than the chat can end the wave later: it drafts the fewest that end
    # it by the chat's end (3: 200 / 3.98 = 50 steps; 2 would take 67)
    assert state().choose(["copy", "chat"], [4, 4], remaining=[200, 64]) == [3, 0]
    # a spared request does not probe; the request that ends the wave does
    c = state()
    for _ in range(8):
        c.observe(["copy", "chat"], [0, 0], [1, 1], None)
    assert c.choose(["copy", "chat"], [4, 4], remaining=[20, 64]) == [0, 1]
    # alone, a request always sets the batch's end
    assert state().choose(["copy"], [4], remaining=[3])[0] > 0


def plan_time(gs: list[list[float]], ks: list[int], remaining: list[int],
              costs: tuple[float, float, float, float], offered: list[float]) -> float:
    """A plan's expected batch time: the slowest request's steps x the step's cost."""
    base, per_row, per_draft, per_verify = costs
    end = max(r / (1.0 + o * sum(g[:k])) for g, k, r, o in zip(gs, ks, remaining, offered))
    rows = sum(o * k for k, o in zip(ks, offered))
    verifies = max((o for k, o in zip(ks, offered) if k > 0), default=0.0)
    return end * (base + per_row * rows + verifies * (per_draft * max(ks) + per_verify))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=3),
                          st.integers(1, 100), st.sampled_from([0.0, 0.1, 0.5, 1.0])),
                min_size=1, max_size=4),
       st.tuples(st.floats(0.01, 1.0), st.floats(0.0, 0.1), st.floats(0.0, 0.1),
                 st.floats(0.0, 0.1)))
def test_the_drain_plan_ends_the_batch_soonest_of_every_plan(reqs, costs):
    ps, remaining, offered = (list(x) for x in zip(*reqs))
    gs = [gains(p, len(p)) for p in ps]
    ks, planned_end = drain_plan(gs, remaining, costs, offered)
    assert all(0 <= k <= len(g) for k, g in zip(ks, gs))
    best = plan_time(gs, ks, remaining, costs, offered)
    for other in itertools.product(*(range(len(g) + 1) for g in gs)):  # every plan
        assert best <= plan_time(gs, list(other), remaining, costs, offered) * (1 + 1e-9)
    # and no request drafts more than it needs to end by the plan's end
    end = max(r / (1.0 + o * sum(g[:k])) for g, k, r, o in zip(gs, ks, remaining, offered))
    assert planned_end == pytest.approx(end)
    for g, k, r, o in zip(gs, ks, remaining, offered):
        assert k == 0 or r / (1.0 + o * sum(g[:k - 1])) > end * (1 + 1e-12)


def test_in_a_drain_drafts_that_pay_plan_without_the_margin():
    # Eight requests alike, each first draft kept 3 times in 4 (~0.8 tokens): it pays at batch
    # 8 (0.615 at 61.5 tokens/s plain) but not by the margin (1.5: 0.88). Under load none
    # drafts; in a drain every one is on the critical path (they end together), and drafting
    # them all brings the batch's end ~1.8x sooner for 1.6x the step. Planned with the margin
    # there, none drafted, and the tie spared all of them.
    rids = [f"r{i}" for i in range(8)]
    c = controller(margin=1.5, num_speculative_tokens=1)
    trained(c, base=0.05, per_row=0.01)
    c.choose(rids, [1] * 8)
    for t in range(40):
        c.observe(rids, [1] * 8, [1 if t % 4 == 0 else 2] * 8, None)
    assert all(0.7 < c.estimate(r)[0] < 0.9 for r in rids)
    assert c.choose(rids, [1] * 8) == [0] * 8
    assert c.choose(rids, [1] * 8, remaining=[64] * 8) == [1] * 8
    # a request sure to finish first is still spared
    assert c.choose(rids, [1] * 8, remaining=[10] + [64] * 7) == [0] + [1] * 7


def test_measuring_a_class_drafts_at_most_explore_k_a_request():
    # copy at batch 32 with a cap of 16: the whole cap was 544 rows in one step (~1.3 s of a
    # 19 s wave); EXPLORE_K a request measures the rows as well. Pinned requests keep their cap.
    c = controller(num_speculative_tokens=16)
    rids = [f"r{i}" for i in range(32)]
    c.choose(rids, [16] * 32)
    c.observe(rids, [0] * 32, [1] * 32, 0.16)  # a plain step: known, its rows unmeasured
    assert not c.cost.rows_measured(32)
    ks = c.choose(rids, [16] * 31 + [2], pinned=[True] + [False] * 31)
    assert ks == [16] + [EXPLORE_K] * 30 + [2]
    assert c.min_gains(rids) == [0.0] * 32  # every draft of that step is verified
    c.observe(rids, ks, [1] * 32, 0.16 + 0.0025 * sum(ks))
    assert c.cost.rows_measured(32)



def test_in_a_drain_a_request_its_proposer_rarely_has_drafts_for_sets_the_end_undrafted():
    # mix in a wave: four chats whose drafts would be kept ~60% end sooner drafting 2 a step,
    # and the copies keep up by drafting one; but where the chats' proposer has a draft one step
    # in ten, drafting cannot shorten them, and the copies, sure to finish first, draft nothing
    copy, chat = [1.0, 1.0, 1.0, 1.0], gains([0.6, 0.7, 0.7, 0.7], 4)
    costs = (0.1, 0.003, 0.0, 0.0)  # a row: 3% of a plain step
    ks, _ = drain_plan([copy] * 4 + [chat] * 4, [64] * 8, costs, [1.0] * 8)
    assert ks == [1] * 4 + [2] * 4
    ks, end = drain_plan([copy] * 4 + [chat] * 4, [64] * 8, costs, [1.0] * 4 + [0.1] * 4)
    assert (ks, end) == ([0] * 8, 64.0)


def test_the_controller_learns_how_often_a_proposer_has_a_draft():
    c = controller()
    trained(c, base=0.05, per_row=0.002)
    rids = ["copy", "chat"]
    assert c.offered("new") == 1.0  # nothing seen: drafts come
    c.choose(rids, [4, 4])
    for t in range(20):  # what either verifies is kept; the chat is offered a draft 1 in 5
        ks = c.choose(rids, [4, 4])
        assert min(ks) > 0  # both asked every step
        chat = ks[1] if t % 5 == 0 else 0
        c.observe(rids, [ks[0], chat], [ks[0] + 1, chat + 1], None)
    assert c.offered("copy") > 0.95 and c.offered("chat") < 0.4
    pool = c.offered("new")
    assert 0.4 < pool < 1.0  # the pool learned too
    for _ in range(20):  # not asked (no room left): the record fades back to the pool's
        c.choose(rids, [0, 0])
        c.observe(rids, [0, 0], [1, 1], None)
    assert c.offered("chat") == pytest.approx(pool, abs=0.02)
    c.forget("chat")
    assert c.offered("chat") == pool


def test_a_draft_its_proposer_rarely_has_pays_the_verify_steps_fixed_cost_alone():
    # b = 8: a plain step 80 ms, a verify row 2 ms, 20 ms more for a step verifying any draft.
    # Eight chats whose first draft is kept 60% of the time: offered every step, the fixed cost
    # is shared by eight drafts (12.8 tokens in 116 ms against 8 in 80) and they pay; offered
    # one step in ten, a step with a draft has about one, and 8.5 tokens in 93 ms do not.
    costs = (0.08, 0.002, 0.0, 0.02)
    chat = [0.6]
    assert rate_plan([chat] * 8, [1.0] * 8, costs)[0] == [1] * 8
    assert rate_plan([chat] * 8, [0.1] * 8, costs) == ([0] * 8, pytest.approx(100.0))
    # four copies pay the fixed cost every step: the chats' drafts then pay for their rows
    copy = [1.0] * 4
    ks, rate = rate_plan([copy] * 4 + [chat] * 4, [1.0] * 4 + [0.1] * 4, costs)
    assert ks == [4] * 4 + [1] * 4
    assert rate == pytest.approx((8 + 16 + 4 * 0.1 * 0.6) / (0.08 + 0.02 + 0.002 * 16.4))


def rate_plan_by_cap(gains_: list[list[float]], offered: list[float],
                     costs: tuple[float, float, float, float]) -> tuple[list[int], float]:
    """`rate_plan` written out plainly: for each cap on the longest draft, every prefix of the
    candidates under it sorted by gain; the first plan of the best rate."""
    base, per_row, per_draft, per_verify = costs
    best, best_rate = [0] * len(gains_), len(gains_) / base
    cands = sorted((-g, j, i) for i, gs in enumerate(gains_) for j, g in enumerate(gs))
    for cap in range(1, max((len(gs) for gs in gains_), default=0) + 1):
        kept, rows, none_log, ks = 0.0, 0.0, 0.0, [0] * len(gains_)
        for neg_gain, j, i in cands:
            if j >= cap:
                continue
            o = min(max(offered[i], 0.0), 1.0)
            kept += o * -neg_gain
            tokens = len(gains_) + kept
            rows += o
            none_log += math.log1p(-min(o, 1.0 - 1e-12)) if j == 0 else 0.0
            ks[i] += 1
            verifies = 1.0 - math.exp(none_log)
            rate = tokens / (base + verifies * (per_verify + per_draft * cap) + per_row * rows)
            if rate > best_rate:
                best, best_rate = list(ks), rate
    return best, best_rate


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=6),
                          st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0])), min_size=1, max_size=6),
       st.tuples(st.floats(0.01, 1.0), st.floats(0.0, 0.1), st.floats(0.0, 0.1),
                 st.floats(0.0, 0.1)))
def test_the_rate_plan_is_the_best_prefix_under_every_cap(reqs, costs):
    ps, offered = (list(x) for x in zip(*reqs))
    gs = [gains(p, len(p)) for p in ps]
    ks, rate = rate_plan(gs, offered, costs)
    want_ks, want_rate = rate_plan_by_cap(gs, offered, costs)
    assert rate == pytest.approx(want_rate, rel=1e-12)
    assert ks == want_ks


@pytest.mark.parametrize("offered", [1.0, 0.5, 0.1])
def test_at_batch_1_how_often_a_draft_comes_does_not_decide_whether_to_ask(offered):
    # one request: a step without a draft costs a plain decode, so asking pays exactly when a
    # draft, once there, pays (the 40 ms fixed cost of `_batch1_costs`)
    costs = (0.06, 0.0025, 0.0, 0.04)
    assert rate_plan([gains([0.4] * 8, 8)], [offered], costs)[0] == [0]
    assert rate_plan([gains([0.9] * 8, 8)], [offered], costs)[0][0] > 0


def test_the_decision_record_says_why_each_k():
    c = controller(probe_every=3)
    assert c.decision() is None  # nothing planned yet
    assert c.choose(["a", "b"], [4, 4]) == [0, 0]
    off = c.decision()
    assert (off.plan, off.ks, off.caps, off.why, off.gain, off.costs) == (
        "off", [0, 0], [4, 4], ["plan", "plan"], None, None)  # nothing measured at batch 2
    trained(c, base=0.05, per_row=0.01)
    for _ in range(20):  # b's drafts are all kept, a's all rejected
        c.choose(["a", "b"], [4, 4])
        c.observe(["a", "b"], [4, 4], [1, 5], None)
    ks = c.choose(["a", "b"], [4, 2], pinned=[False, False])
    d = c.decision()
    assert d.plan == "rate" and d.rids == ["a", "b"] and d.ks == ks and d.caps == [4, 2]
    assert ks[0] in (0, 1) and ks[1] == 2
    want = [gains(c.estimate(r), cap) for r, cap in zip(["a", "b"], [4, 2])]
    assert d.acceptance == [c.estimate("a")[0], c.estimate("b")[0]]
    assert d.gain == [sum(g[:k]) for g, k in zip(want, ks)]
    assert d.next_gain == [want[0][ks[0]], 0.0]  # b is at its cap
    assert d.floor == c.floor and d.rate is not None
    base, per_row, per_draft, per_verify = d.costs
    assert d.step_s == pytest.approx(base + per_row * sum(ks) + per_draft * 2 + per_verify)
    c.observe(["a", "b"], ks, [1, 3], None)
    whys = []
    for _ in range(4):  # a, at 0, is probed once its wait is over
        ks = c.choose(["a", "b"], [4, 4], pinned=[False, True])
        whys.append(c.decision().why)
        c.observe(["a", "b"], ks, [1, 5], None)
    assert ["probe", "pinned"] in whys and all(w[1] == "pinned" for w in whys)
    c.choose(["a", "b"], [4, 4], remaining=[3, 40])
    assert c.decision().plan == "drain"
    f = controller("fixed")
    f.choose(["a"], [3])
    assert (f.decision().plan, f.decision().ks, f.decision().why) == ("fixed", [3], ["plan"])


def test_the_decision_becomes_aligned_span_attributes_with_prefills_first():
    c = controller()
    trained(c, base=0.05, per_row=0.01)
    ks = c.choose(["a", "b"], [4, 1])
    attrs = span_attributes(c.decision(), ["new"])
    assert attrs["spec.request.ids"] == ("new", "a", "b")
    assert attrs["spec.control.k"] == (0, *ks) and attrs["spec.control.cap"] == (0, 4, 1)
    assert attrs["spec.control.why"] == ("prefill", "plan", "plan")
    assert attrs["spec.control.plan"] == "rate"
    for name in ("acceptance", "gain", "next_gain", "offered"):
        assert len(attrs[f"spec.control.{name}"]) == 3
    assert {"spec.control.cost.base_s", "spec.control.step_s", "spec.control.rate"} <= set(attrs)
    c2 = controller()
    c2.choose(["a"], [4])  # off: no estimate used, no cost known, floor infinite
    attrs = span_attributes(c2.decision(), [])
    assert attrs["spec.control.plan"] == "off" and "spec.control.gain" not in attrs
    assert "spec.control.floor" not in attrs and "spec.control.step_s" not in attrs
