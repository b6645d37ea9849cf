"""Hang detection: the stall bound follows observed step times, between a floor and a ceiling."""

from __future__ import annotations

from pipeline.engine.stall import COLD_STEPS, MIN_SAMPLES, StallDetector, plan_tokens
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


def test_right_after_a_rebuild_the_bound_is_the_adapted_one_not_the_ceiling():
    d = StallDetector(floor_s=5, multiple=10, ceiling_s=30)  # the default config's knobs
    d.record(0.4, 40)  # the first steps of fresh stages: 10 ms per token
    for _ in range(300):
        d.record(0.1, 40)  # then 2.5 ms per token (the cold step has left the p99 window)
    assert d.bound(40) == 5
    rebuilt = d.carry_over()
    # fresh stages' first steps: the cold time per token (10 x 10 ms x 40 = 4 s) under the floor
    assert rebuilt.bound(40) == 5
    for _ in range(COLD_STEPS):
        assert rebuilt.bound(40) <= 10
        rebuilt.record(0.1, 40)
    assert rebuilt.bound(40) == 5
    assert rebuilt.bound(400) == 10  # still scaled by the step's tokens


def test_after_a_rebuild_a_slow_cold_start_keeps_its_allowance_for_the_first_steps():
    d = StallDetector(floor_s=5, multiple=10, ceiling_s=30)
    d.record(3.0, 40)  # a GPU's first step (kernel loading): 75 ms per token
    for _ in range(300):
        d.record(0.02, 40)
    rebuilt = d.carry_over()
    assert rebuilt.bound(40) == 30  # min(ceiling, 10 x 75 ms x 40)
    for _ in range(COLD_STEPS):
        rebuilt.record(0.02, 40)
    assert rebuilt.bound(40) == 5


def test_the_engine_actor_carries_the_stall_timings_into_its_rebuilt_core(monkeypatch):
    import asyncio

    import actors.engine as engine_mod
    from pipeline.config import EngineConfig
    from pipeline.engine.stage_rebuild import Replace

    class FakeActors:
        def __init__(self):
            self.info = {"vocab_size": 256}

        async def flush_telemetry(self):
            pass

        def kill(self):
            pass

    groups = []

    async def fake_create(config, report=lambda _: None, group_name=""):
        groups.append(group_name)
        return FakeActors()

    async def nothing_answers(*_args):
        return Replace(draft=True, verifiers=True, output=True)

    monkeypatch.setattr(engine_mod, "create_stage_actors", fake_create)
    monkeypatch.setattr(engine_mod, "reset_survivors", nothing_answers)  # all rebuilt
    config = EngineConfig()
    assert (config.step_timeout_floor_s, config.step_timeout_p99_multiple) == (5.0, 10.0)

    async def scenario():
        engine = engine_mod.Engine(config)
        await engine._build()
        first = engine.core
        assert first.stall.bound(40) == config.step_timeout_s  # nothing timed yet
        for _ in range(MIN_SAMPLES + 4):
            first.stall.record(0.1, 40)
        await first.stop()
        await engine._rebuild()
        assert engine.core is not first and engine.restarts == 1
        bound = engine.core.stall.bound(40)
        await engine.core.stop()
        return bound

    assert asyncio.run(scenario()) <= 10  # docs/reliability.md: 10 s at the default config
    # each build's placement group has a name of its own (remove_stage_groups finds them all)
    assert len(groups) == 2 and groups[0] != groups[1]
    assert all(g.startswith("specrelay-stages:") for g in groups)
