"""Scheduler: bounded FIFO queue, admission by free slots, release on the next plan, draft caps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.engine.scheduler import Scheduler
from pipeline.engine.spec.policy import SpecController
from pipeline.errors import EngineOverloadedError
from pipeline.params import SamplingParams
from pipeline.protocol import EngineCall, StepOutcome
from pipeline.spec_settings import SpecSettings


def make(max_running=2, max_waiting=3, max_model_len=32, k=4, reserved_slots=0) -> Scheduler:
    return Scheduler(max_running, max_waiting, max_model_len, k, vocab_size=100,
                     reserved_slots=reserved_slots)


def add(s: Scheduler, rid: str, prompt_ids: list[int], params: SamplingParams,
        group: str | None = None) -> None:
    """Queue a request the way the engine does (validate, then enqueue)."""
    s.enqueue(s.prepare(EngineCall(rid, prompt_ids, params, group=group)))


def outcome(plan, tokens_per_rid):
    rids = plan.rids
    return StepOutcome(plan.step, rids, [tokens_per_rid[r] for r in rids],
                       [0] * len(rids))


def test_admits_fifo_up_to_free_slots_and_queues_the_rest():
    s = make()
    for rid in "abc":
        add(s, rid, [1, 2], SamplingParams(max_new_tokens=5))
    plan = s.schedule()
    assert [n.rid for n in plan.new] == ["a", "b"] and plan.decode == []
    assert [r.rid for r in s.waiting] == ["c"] and s.free_slots == 0


def test_queue_full_raises_overloaded():
    s = make(max_waiting=1)
    add(s, "a", [1], SamplingParams())
    with pytest.raises(EngineOverloadedError, match="full"):
        add(s, "b", [1], SamplingParams())


def test_finished_request_is_released_in_the_next_plan_and_its_slot_reused():
    s = make(max_running=1)
    add(s, "a", [1, 2], SamplingParams(max_new_tokens=5))
    add(s, "b", [3], SamplingParams(max_new_tokens=5))
    plan = s.schedule()
    s.apply(outcome(plan, {"a": [7]}))
    s.finish("a")
    plan = s.schedule()
    assert plan.release == ["a"] and [n.rid for n in plan.new] == ["b"]
    # its last step's tokens were never committed: they ride with the release, once
    assert "a" not in plan.commits and plan.finals == {"a": [7]}
    s.apply(outcome(plan, {"b": [8]}))
    assert s.schedule().finals == {}


def test_decode_plan_carries_last_token_kv_len_and_commits():
    s = make()
    add(s, "a", [1, 2, 3], SamplingParams(max_new_tokens=10))
    s.apply(outcome(s.schedule(), {"a": [9]}))
    plan = s.schedule()
    assert plan.decode == ["a"] and plan.last_tokens == [9] and plan.kv_lens == [3]
    assert plan.num_outputs == [1] and plan.ks == [4] and plan.commits == {"a": [9]}
    s.apply(outcome(plan, {"a": [4, 5, 6]}))
    plan = s.schedule()
    assert plan.last_tokens == [6] and plan.kv_lens == [6] and plan.commits == {"a": [4, 5, 6]}


def test_drafts_capped_by_remaining_output_and_max_model_len():
    s = make(max_model_len=8)
    add(s, "a", [1, 2, 3], SamplingParams(max_new_tokens=100))
    assert s.running == {} and next(iter(s.waiting)).params.max_new_tokens == 5  # 8 - 3 prompt tokens
    s.apply(outcome(s.schedule(), {"a": [9]}))
    s.apply(outcome(s.schedule(), {"a": [1, 1]}))  # 3 outputs, seq len 6
    assert s.schedule().ks == [1]  # only 2 more tokens may be kept: 1 draft + 1
    s2 = make(max_model_len=100, k=4)
    add(s2, "b", [1], SamplingParams(max_new_tokens=3))
    s2.apply(outcome(s2.schedule(), {"b": [9]}))
    assert s2.schedule().ks == [1]


def test_request_at_its_cap_is_not_scheduled_until_its_finish_arrives():
    s = make()
    add(s, "a", [1], SamplingParams(max_new_tokens=1))
    s.apply(outcome(s.schedule(), {"a": [9]}))
    assert s.schedule() is None
    s.finish("a")
    plan = s.schedule()  # release-only
    assert plan.release == ["a"] and plan.rids == []
    assert s.schedule() is None and s.free_slots == 2


def test_abort_of_waiting_request_removes_it_from_the_queue():
    s = make(max_running=1)
    add(s, "a", [1], SamplingParams())
    add(s, "b", [1], SamplingParams())
    s.schedule()
    assert s.finish("b").rid == "b" and not s.waiting
    assert s.finish("zzz") is None


@pytest.mark.parametrize(("prompt", "msg"), [
    ([], "at least one"), ([1] * 32, "no room"), ([1, 100], "outside"), ([-1], "outside")])
def test_bad_prompts_are_refused(prompt, msg):
    with pytest.raises(ValueError, match=msg):
        add(make(), "a", prompt, SamplingParams())


def test_duplicate_request_id_is_refused():
    s = make()
    add(s, "a", [1], SamplingParams())
    with pytest.raises(ValueError, match="already"):
        add(s, "a", [1], SamplingParams())


def admitted(plan) -> list[str]:
    return [n.rid for n in plan.new]


def test_a_fan_out_keeps_the_reserved_slot_free_for_a_newcomer():
    s = make(max_running=4, max_waiting=64, reserved_slots=1)
    for i in range(16):
        add(s, f"fan-{i}", [1], SamplingParams(max_new_tokens=5), group="fan")
    assert admitted(s.schedule()) == ["fan-0", "fan-1", "fan-2"]  # one slot kept back
    for i in range(4):  # a second fan-out does not take the reserve either
        add(s, f"fan2-{i}", [1], SamplingParams(max_new_tokens=5), group="fan2")
    assert s.schedule() is None
    add(s, "solo", [1], SamplingParams(max_new_tokens=5))
    assert admitted(s.schedule()) == ["solo"]
    assert s.free_slots == 0


def test_a_lone_request_may_use_every_slot_when_nothing_is_reserved_or_slots_are_one():
    s = make(max_running=3, max_waiting=8)
    for i in range(5):
        add(s, f"fan-{i}", [1], SamplingParams(max_new_tokens=5), group="fan")
    assert admitted(s.schedule()) == ["fan-0", "fan-1", "fan-2"]
    one = make(max_running=1, reserved_slots=1)  # the reserve never blocks the only slot
    add(one, "a", [1], SamplingParams(), group="g")
    assert admitted(one.schedule()) == ["a"]


def test_freed_slots_go_to_the_group_holding_fewest_then_round_robin():
    s = make(max_running=2, max_waiting=16)
    for i in range(4):
        add(s, f"a{i}", [1], SamplingParams(max_new_tokens=5), group="A")
    assert admitted(s.schedule()) == ["a0", "a1"]
    add(s, "b0", [1], SamplingParams(max_new_tokens=5), group="B")
    add(s, "b1", [1], SamplingParams(max_new_tokens=5), group="B")
    add(s, "c0", [1], SamplingParams(max_new_tokens=5), group="C")
    s.finish("a0")
    assert admitted(s.schedule()) == ["b0"]  # B (0 held, arrived first) before A's a2 and C
    s.finish("a1")
    assert admitted(s.schedule()) == ["c0"]  # A and C hold none; C was never served
    s.finish("b0")
    assert admitted(s.schedule()) == ["a2"]  # A and B hold none; A was served longest ago
    assert [r.rid for r in s.waiting] == ["a3", "b1"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ABCD"), st.booleans()), min_size=1, max_size=40),
       st.integers(1, 5), st.integers(0, 2))
def test_admission_invariants(events, max_running, reserve):
    """Random arrivals (group, then maybe finish the oldest running): slots are never
    oversubscribed, a waiting group holding no slot is never passed over while more than the
    reserve is free, a lone request never while any slot is free, and within a group choices
    start in arrival order."""
    s = make(max_running=max_running, max_waiting=100, reserved_slots=reserve)
    started: dict[str, list[int]] = {}
    for i, (group, finish) in enumerate(events):
        add(s, f"{group}{i}", [1], SamplingParams(max_new_tokens=5), group=group)
        if finish and s.running:
            s.finish(next(iter(s.running)))
        plan = s.schedule()
        for n in plan.new if plan else []:
            started.setdefault(n.rid[0], []).append(int(n.rid[1:]))
        assert len(s.running) <= max_running
        held = {r.group for r in s.running.values()}
        waiting = list(s.waiting)
        if s.free_slots > min(reserve, max_running - 1):
            assert all(r.group in held for r in waiting)
        if s.free_slots > 0:
            lone = [r for r in waiting if r.group not in held
                    and sum(w.group == r.group for w in waiting) == 1]
            assert lone == []
    for order in started.values():
        assert order == sorted(order)


class SpyController(SpecController):
    """Records what the scheduler tells the controller about a drain."""

    def __init__(self) -> None:
        super().__init__(SpecSettings("fixed", 4))
        self.remaining: list[list[int] | None] = []

    def choose(self, rids, caps, pinned=None, remaining=None):
        self.remaining.append(remaining)
        return super().choose(rids, caps, pinned, remaining)


def test_a_batch_drains_once_its_last_request_is_admitted_and_prefilled():
    spy = SpyController()
    s = Scheduler(2, 3, 64, 4, vocab_size=100, spec=spy)
    p = SamplingParams(max_new_tokens=10)
    add(s, "a", [1], p)
    add(s, "b", [1], p)
    s.enqueue(s.prepare(EngineCall("c", [1], p)), last=True)  # the batch job's final request
    s.apply(outcome(s.schedule(), {"a": [5], "b": [5]}))  # a, b prefill; c waits
    s.apply(outcome(s.schedule(), {"a": [5, 5], "b": [5]}))
    assert spy.remaining[-1] is None  # c still waits: its slot is wanted
    s.finish("b")
    plan = s.schedule()  # c admitted in b's slot: prefills this step
    assert plan.decode == ["a"] and spy.remaining[-1] is None
    s.apply(outcome(plan, {"a": [5], "c": [5]}))
    plan = s.schedule()  # nothing waits or will come, all decode: a drain
    assert plan.decode == ["a", "c"] and spy.remaining[-1] == [6, 9]
    # a request arriving at an idle engine starts a new batch, open until its last one
    s.finish("a")
    s.finish("c")
    s.schedule()  # releases
    assert not s.has_work
    add(s, "d", [1], p)
    s.apply(outcome(s.schedule(), {"d": [5]}))
    s.schedule()
    assert spy.remaining[-1] is None


def test_a_server_never_drains():
    spy = SpyController()
    s = Scheduler(2, 3, 64, 4, vocab_size=100, spec=spy)
    add(s, "a", [1], SamplingParams(max_new_tokens=10))
    s.apply(outcome(s.schedule(), {"a": [5]}))
    s.schedule()
    assert spy.remaining == [None, None]  # nothing waits, but more may come


def test_fan_outs_leave_the_reserved_waiting_places_to_single_requests():
    s = Scheduler(1, 12, 32, 4, vocab_size=100, reserved_waiting=4)
    p = SamplingParams(max_new_tokens=4)
    add(s, "run", [1], p)
    s.schedule()  # the one slot is taken: everything else waits
    refused = []
    for g in range(3):  # three fan-outs of 6 choices: 8 places are theirs
        for c in range(6):
            try:
                add(s, f"f{g}-{c}", [1], p, group=f"f{g}")
            except EngineOverloadedError as e:
                refused.append((g, c, str(e)))
    assert [(g, c) for g, c, _ in refused] == [(1, c) for c in range(2, 6)] + [
        (2, c) for c in range(1, 6)]
    assert "kept for single requests" in refused[0][2]
    # f2's first choice took one reserved place (a refused fan-out gives it back)
    assert len(s.waiting) == 9 and s.waiting.count("f2") == 1
    for i in range(3):  # the rest of the reserve: single requests
        add(s, f"single{i}", [1], p)
    with pytest.raises(EngineOverloadedError, match="full"):
        add(s, "one-too-many", [1], p)


def _paged(num_blocks: int, reserved_slots: int = 0) -> Scheduler:
    return Scheduler(8, 10, 64, 4, vocab_size=100, reserved_slots=reserved_slots,
                     num_blocks=num_blocks, block_size=16)


def test_admission_counts_kv_blocks_and_keeps_a_reserve_for_a_lone_request():
    s = _paged(num_blocks=10, reserved_slots=1)
    for i in range(4):  # a fan-out: 3 blocks each (30 prompt tokens + 1 + 4 drafts)
        add(s, f"g{i}", [1] * 30, SamplingParams(max_new_tokens=20), group="g")
    plan = s.schedule()
    # 10 -> 7 -> 4 free blocks; a third would leave 1, less than one more request of its size
    assert [n.rid for n in plan.new] == ["g0", "g1"] and s.free_slots == 6
    s.apply(outcome(plan, {"g0": [5], "g1": [5]}))
    add(s, "solo", [2] * 10, SamplingParams(max_new_tokens=20))
    plan = s.schedule()
    assert plan.decode == ["g0", "g1"] and [n.rid for n in plan.new] == ["solo"]
    assert s.blocks_used == 3 + 3 + 1


def test_the_newest_request_is_preempted_and_resumes_with_its_output_as_prompt():
    s = _paged(num_blocks=4)
    add(s, "a", [1] * 20, SamplingParams(max_new_tokens=40))
    add(s, "b", [2] * 20, SamplingParams(max_new_tokens=40))
    plan = s.schedule()
    assert [n.rid for n in plan.new] == ["a", "b"]
    s.apply(outcome(plan, {"a": [7] * 1, "b": [8] * 1}))
    plan = s.schedule()          # 20 + 1 + 4 drafts: 2 blocks each
    s.apply(outcome(plan, {"a": [7] * 5, "b": [8] * 5}))
    plan = s.schedule()          # 25 + 1 + 4 = 30: still 2 each
    assert plan.decode == ["a", "b"] and plan.release == []
    s.apply(outcome(plan, {"a": [7] * 5, "b": [9] * 5}))
    plan = s.schedule()          # 30 + 1 + 4 = 35: 3 each, 6 > 4: b (newest) goes
    assert plan.decode == ["a"] and plan.release == ["b"] and plan.new == []
    assert "b" not in plan.commits and s.preemptions == 1
    assert [r.rid for r in s.waiting] == ["b"]
    s.apply(outcome(plan, {"a": [7]}))
    s.finish("a")
    plan = s.schedule()
    assert plan.release == ["a"]
    (new,) = plan.new
    assert new.rid == "b" and new.num_output == 11
    assert new.prompt_ids == [2] * 20 + [8] * 6 + [9] * 5
