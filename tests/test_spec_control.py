"""Adaptive speculation's choice of k (pipeline.engine.spec_control), with literal expectations."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.engine.spec_control import Acceptance, CostModel, SpecController, SpecSettings


def controller(mode: str = "adaptive", max_k: int = 4, **kw) -> SpecController:
    return SpecController(SpecSettings(mode, max_k, **kw))


def trained(c: SpecController, base: float, per_row: float, steps: int = 40) -> None:
    """Feed the cost model exact linear step times over varied row counts."""
    for i in range(steps):
        rows = 1 + i % 9
        c.cost.observe(rows, 0, base + per_row * rows)


def test_the_ema_learns_conditional_acceptance_only_at_positions_the_verifier_saw():
    a = Acceptance([0.5, 0.5, 0.5, 0.5])
    a.update(drafted=4, accepted=1, alpha=0.5)  # position 0 accepted, 1 rejected, 2-3 unseen
    assert a.p == [0.75, 0.25, 0.5, 0.5]
    a.update(drafted=1, accepted=1, alpha=0.5)  # a one-draft step accepted whole
    assert a.p == [0.875, 0.25, 0.5, 0.5]
    assert a.gains(3) == [0.875, 0.21875, 0.109375]


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
    base, per_row, per_draft = m.coefficients(0)
    assert (base, per_row, per_draft) == pytest.approx((0.05, 0.01, 0.002), abs=1e-4)


def test_cheap_rows_and_good_acceptance_draft_the_most():
    c = controller()
    trained(c, base=0.05, per_row=0.001)
    for _ in range(20):
        c.observe(["a"], [4], [5], None)  # everything accepted
    assert c.choose(["a"], [4]) == [4]


def test_a_request_that_never_gets_a_draft_accepted_gets_none():
    c = controller()
    trained(c, base=0.05, per_row=0.01)
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
    for _ in range(30):
        c.observe(good, [4, 4], [5, 5], None)
        c.observe(bad, [1] * 6, [1] * 6, None)
    ks = c.choose(rids, [4] * 8)
    assert ks[2:] == [0] * 6
    assert ks[:2] == [4, 4]


def test_a_request_left_at_zero_is_probed_with_one_draft():
    c = controller(probe_every=3)
    trained(c, base=0.05, per_row=0.01)
    for _ in range(20):
        c.observe(["a"], [4], [1], None)
    assert [c.choose(["a"], [4])[0] for _ in range(6)] == [0, 0, 1, 0, 0, 1]


def test_caps_are_respected_and_forget_resets_a_request():
    c = controller()
    trained(c, base=0.05, per_row=0.0001)
    for _ in range(20):
        c.observe(["a"], [4], [5], None)
    assert c.choose(["a"], [2]) == [2]
    c.forget("a")
    assert c._state("a").p == [0.5] * 4


@pytest.mark.parametrize("field,value", [("speculation", "always"), ("spec_ema_alpha", 0),
                                          ("spec_prior", 1.5), ("spec_probe_every", 0),
                                          ("spec_cost_decay", "x")])
def test_bad_speculation_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        load_config("configs/tiny.yaml", {field: value})


def test_a_pinned_request_gets_its_cap_whatever_its_acceptance():
    c = controller()
    trained(c, base=0.05, per_row=0.01)
    for _ in range(20):
        c.observe(["a", "b"], [4, 4], [1, 1], None)
    assert c.choose(["a", "b"], [4, 3], pinned=[False, True]) == [0, 3]
