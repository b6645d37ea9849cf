"""Async scheduling: a step of decodes without drafts is followed by one planned and sent before
its outcome returns (`Scheduler.plan_ahead`), whose rows the verifier feeds with the token it
sampled last. The scheduler's side as a property against a model of the stages, then the engine
and the verifier."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.engine_cases import PROMPTS, expected_cut, mixed_requests
from support.reference_decode import target_references

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine, collect
from pipeline.engine.scheduler import Scheduler
from pipeline.params import SamplingParams
from pipeline.protocol import EngineCall, NewRequest, StepOutcome, StepPlan

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"
STOP = 7  # the model's "stop token" below


def make(k: int = 0, slots: int = 2, max_model_len: int = 32, num_blocks: int | None = None,
         max_waiting: int = 8) -> Scheduler:
    return Scheduler(slots, max_waiting, max_model_len, k, vocab_size=100,
                     num_blocks=num_blocks, block_size=4)


def add(s: Scheduler, rid: str, prompt: list[int], params: SamplingParams) -> None:
    s.enqueue(s.prepare(EngineCall(rid, prompt, params)))


def outcome(plan: StepPlan, tokens: dict[str, list[int]]) -> StepOutcome:
    rids = [n.rid for n in plan.new] + plan.decode
    return StepOutcome(plan.step, rids, [tokens[r] for r in rids], [0] * len(rids))


def running_pair(k: int = 0, max_new_tokens: int = 10, **kwargs) -> tuple[Scheduler, StepPlan]:
    """Two requests past their prefill; the plan of their first verify step."""
    s = make(k, **kwargs)
    add(s, "a", [1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens))
    add(s, "b", [4, 5], SamplingParams(max_new_tokens=max_new_tokens))
    s.apply(outcome(s.schedule(), {"a": [10], "b": [20]}))
    return s, s.schedule()


def test_the_step_ahead_is_one_token_further_and_takes_the_verifiers_last_token():
    s, plan = running_pair()
    assert plan.decode == ["a", "b"] and plan.ks == [0, 0] and plan.last_tokens == [10, 20]
    ahead = s.plan_ahead(plan)
    assert ahead.step == plan.step + 1 and ahead.decode == ["a", "b"]
    assert ahead.last_tokens == [-1, -1] and ahead.ks == [0, 0] and not ahead.commits
    assert ahead.kv_lens == [n + 1 for n in plan.kv_lens]
    assert ahead.num_outputs == [n + 1 for n in plan.num_outputs]
    s.apply(outcome(plan, {"a": [11], "b": [21]}))
    s.apply(outcome(ahead, {"a": [12], "b": [22]}))
    after = s.schedule()  # planned from the outcomes again
    assert after.step == ahead.step + 1 and after.last_tokens == [12, 22]
    assert after.kv_lens == [n + 1 for n in ahead.kv_lens]
    # the steps' tokens reach the stages in order, as without async scheduling
    assert after.commits == {"a": [11, 12], "b": [21, 22]}


def test_no_step_ahead_where_the_next_plan_needs_the_outcome():
    s, plan = running_pair(k=4)
    assert plan.ks == [4, 4] and s.plan_ahead(plan) is None  # drafts: lengths unknown
    s = make()
    add(s, "a", [1, 2, 3], SamplingParams(max_new_tokens=10))
    first = s.schedule()
    assert s.plan_ahead(first) is None  # a prefill: its row has no token yet
    s, plan = running_pair(slots=3)
    add(s, "c", [6], SamplingParams(max_new_tokens=10))
    assert s.plan_ahead(plan) is None  # a waiting request and a free slot: admit it first
    s, plan = running_pair()
    s.finish("a")
    assert s.plan_ahead(plan) is None  # a release to send
    s, plan = running_pair(max_new_tokens=2)
    assert s.plan_ahead(plan) is None  # its last token is in flight
    s, plan = running_pair(num_blocks=2)  # 3 + 2 tokens fill 2 blocks of 4 ...
    assert s.plan_ahead(plan) is None  # ... and one more each would not fit
    s = make()
    add(s, "g", [1, 2], SamplingParams(max_new_tokens=10, grammar=lambda: None))
    s.apply(outcome(s.schedule(), {"g": [3]}))
    assert s.plan_ahead(s.schedule()) is None  # a grammar advances by commits only


def test_a_row_at_its_last_token_drops_out_of_the_step_ahead():
    s = make()
    add(s, "a", [1, 2, 3], SamplingParams(max_new_tokens=2))
    add(s, "b", [4, 5], SamplingParams(max_new_tokens=10))
    s.apply(outcome(s.schedule(), {"a": [10], "b": [20]}))
    ahead = s.plan_ahead(s.schedule())
    assert ahead.decode == ["b"]


class ModelStages:
    """What the verifier holds per request (its KV length and samples), checking each plan."""

    def __init__(self, rng: random.Random, max_model_len: int) -> None:
        self.rng = rng
        self.max_model_len = max_model_len
        self.kv: dict[str, int] = {}
        self.samples: dict[str, list[int]] = {}
        self.caps: dict[str, int] = {}

    def token(self) -> int:
        return STOP if self.rng.random() < 0.08 else self.rng.randrange(10, 100)

    def run(self, plan: StepPlan) -> StepOutcome:
        for rid in plan.release:
            del self.kv[rid], self.samples[rid]
        tokens = {}
        for new in plan.new:
            assert new.rid not in self.kv
            self.kv[new.rid] = len(new.prompt_ids)
            self.samples[new.rid] = list(new.prompt_ids[len(new.prompt_ids) - new.num_output:]
                                         if new.num_output else [])
            self.caps[new.rid] = new.params.max_new_tokens
            tokens[new.rid] = [self.token()]
        for rid, last, kv, n, k in zip(plan.decode, plan.last_tokens, plan.kv_lens,
                                       plan.num_outputs, plan.ks):
            samples = self.samples[rid]
            assert n == len(samples) and kv <= self.kv[rid]  # counts as the stage holds them
            assert last in (-1, samples[-1])  # -1: the stage's own last sample
            self.kv[rid] = kv + 1 + k
            assert self.kv[rid] <= self.max_model_len
            tokens[rid] = [self.token() for _ in range(1 + self.rng.randrange(k + 1))]
        out = outcome(plan, tokens)
        for rid, got in zip(out.rids, out.tokens):
            self.samples[rid] += got
            assert len(self.samples[rid]) <= self.caps[rid]  # never past max_tokens
        return out


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 20), st.integers(0, 4)),
                min_size=1, max_size=7),
       st.integers(0, 2), st.sampled_from([None, 12, 20]), st.randoms(use_true_random=False))
def test_steps_ahead_keep_every_plan_true_to_the_stages(reqs, k, num_blocks, rng):
    """Requests arrive over time, finish by a stop token (seen a step late, as the engine sees
    it) or by length; every plan, ahead or not, matches what the stages hold."""
    s = make(k=k, slots=3, max_model_len=40, num_blocks=num_blocks)
    stages = ModelStages(rng, 40)
    arrivals = {}
    for i, (prompt, max_new, step) in enumerate(reqs):
        arrivals.setdefault(step, []).append((f"r{i}", [1 + j for j in range(prompt)],
                                              SamplingParams(max_new_tokens=max_new)))
    ahead, finished, late, aheads = None, set(), [], 0
    for tick in range(400):
        for rid, prompt, params in arrivals.pop(tick, []):
            add(s, rid, prompt, params)
        for rid in late:
            s.finish(rid)
        late = []
        plan, ahead = (ahead, None) if ahead is not None else (s.schedule(), None)
        if plan is None:
            if not arrivals:
                break
            continue
        out = stages.run(plan)
        ahead = s.plan_ahead(plan)
        aheads += ahead is not None
        s.apply(out)
        for rid, got in zip(out.rids, out.tokens):
            req = s.running.get(rid)
            if rid not in finished and (STOP in got or (req and req.remaining <= 0)):
                finished.add(rid)
                late.append(rid)
    assert finished == {f"r{i}" for i in range(len(reqs))}
    assert not s.running and not s.waiting
    if k == 0 and any(max_new > 2 for _, max_new, _ in reqs) and num_blocks is None:
        assert aheads > 0 or all(STOP in v[:2] for v in stages.samples.values())


# --- the engine and the verifier ---------------------------------------------------------------
@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return target_references(CONFIG, PROMPTS, 60, {"device": "cpu", "dtype": "float32"})


@pytest.mark.parametrize("overlap", [True, False])
def test_async_scheduling_outputs_what_planning_every_step_does(overlap, reference):
    requests = mixed_requests(8)
    got = {}
    for on in (True, False):
        core = build_local_engine(load_config(CONFIG, {
            "draft": "none", "overlap": overlap, "async_scheduling": "on" if on else "off"}))
        got[on] = asyncio.run(collect(core, requests))
        assert (core.stats.steps_ahead > core.stats.steps // 2) if on else \
            core.stats.steps_ahead == 0
        assert core.stages.verifier.runner.num_free() == core.scheduler.max_running
    assert build_local_engine(load_config(CONFIG, {"draft": "none"})).async_scheduling is False
    for rid, prompt, params in requests:
        want_ids, want_text = expected_cut(reference[PROMPTS.index(prompt)], params)
        for on in (True, False):
            assert got[on][rid].token_ids == want_ids
            assert got[on][rid].text == want_text
        assert got[True][rid].finish_reason == got[False][rid].finish_reason
        assert got[True][rid].logprobs == got[False][rid].logprobs


def test_a_rank_that_did_not_sample_refuses_a_row_without_its_token():
    from pipeline.models.runners import build_runner
    from pipeline.verify.verifier import Verifier

    runner = build_runner(load_config(CONFIG, {"draft": "none"}), "target")
    rank = Verifier(runner, driver=False)
    rank.step(StepPlan(0, new=[NewRequest("a", [3, 4, 5], SamplingParams())]), None)
    with pytest.raises(ValueError, match="last step sampled for 'a'"):
        rank.step(StepPlan(1, decode=["a"], last_tokens=[-1], kv_lens=[3], num_outputs=[1],
                           ks=[0]), None)
