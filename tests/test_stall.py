"""Hang detection: the stall bound follows observed step times, between a floor and a ceiling."""

from __future__ import annotations

from pipeline.engine.stall import MIN_SAMPLES, StallDetector, plan_tokens
from pipeline.params import SamplingParams
from pipeline.protocol import NewRequest, StepPlan


def test_the_ceiling_holds_until_enough_steps_were_timed():
    d = StallDetector(floor_s=5, multiple=10, ceiling_s=30)
    for _ in range(MIN_SAMPLES - 1):
        d.record(0.1, 40)
    assert d.bound(40) == 30


def test_fast_steps_bring_the_bound_down_to_the_floor():
    d = StallDetector(floor_s=5, multiple=10, ceiling_s=30)
    for _ in range(MIN_SAMPLES):
        d.record(0.1, 40)  # 2.5 ms per token
    assert d.bound(40) == 5  # 10 x 0.1 s = 1 s is under the floor


def test_the_bound_scales_with_the_step_tokens_and_the_p99_up_to_the_ceiling():
    d = StallDetector(floor_s=5, multiple=10, ceiling_s=30)
    for _ in range(100):
        d.record(0.1, 40)
    d.record(1.0, 40)  # one slow step in 101 is the p99 region, not the median
    assert 5 < d.bound(400) <= 30  # a ten-times larger step (a long prefill) gets more time
    assert d.bound(100_000) == 30


def test_slow_steps_raise_the_bound():
    d = StallDetector(floor_s=1, multiple=10, ceiling_s=60)
    for _ in range(MIN_SAMPLES):
        d.record(0.5, 10)  # 50 ms per token
    assert d.bound(10) == 5.0


def test_a_ceiling_below_the_floor_caps_it():
    d = StallDetector(floor_s=5, multiple=10, ceiling_s=0.5)
    for _ in range(MIN_SAMPLES):
        d.record(0.001, 10)
    assert d.bound(10) == 0.5


def test_plan_tokens_counts_prompts_and_k_plus_one_per_verify():
    plan = StepPlan(step=0, new=[NewRequest("a", [1, 2, 3], SamplingParams())],
                    decode=["b", "c"], ks=[4, 0])
    assert plan_tokens(plan) == 3 + 5 + 1
