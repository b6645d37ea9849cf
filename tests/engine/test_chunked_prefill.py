"""Chunked prefill (`max_num_batched_tokens`): a step's target forward computes at most the
budget's tokens (verify rows first, prompt chunks fill the rest), a prompt may be prefilled over
several steps and yields its first token only from its last chunk; output never depends on the
budget (greedy: identical tokens) under every draft kind, with prefix caching on and off, with
preemption, with grammars; long prompts arriving while streams run never stall the engine; the
plan's chunk fields cross the strict codec."""

from __future__ import annotations

import asyncio
import random
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine, collect
from pipeline.engine.scheduler import Scheduler
from pipeline.output.request_output import Completion
from pipeline.params import SamplingParams
from pipeline.protocol import (
    EngineCall,
    NewRequest,
    ProtocolError,
    StepOutcome,
    StepPlan,
    decode_new_request,
    decode_plan,
    encode_new_request,
    encode_plan,
)
from pipeline.protocol.step_codec import pack, unpack

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"  # max_model_len 256, block_size 16, num_slots 8
BUDGETS = [16, 64, 512, None]  # None: no budget, a whole prompt per step


def _requests(n: int, seed: int = 0):
    """Prompts of 60-200 tokens (several chunks at a budget of 16 or 64) sharing a 48-token
    prefix (prefix caching hits it), repetitive enough for n-gram and suffix drafting."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(48)]
    reqs = []
    for i in range(n):
        unit = [rng.randrange(3, 250) for _ in range(rng.randrange(3, 7))]
        prompt = shared + (unit * 40)[: rng.randrange(12, 150)]
        reqs.append((f"r{i}", prompt, SamplingParams(max_new_tokens=20 + i % 5 * 4,
                                                     ignore_eos=True)))
    return reqs


def _engine(overrides: dict):
    core = build_local_engine(load_config(CONFIG, {"attention_backend": "sdpa", **overrides}))
    plans: list[StepPlan] = []
    schedule = core.scheduler.schedule

    def spy():
        plan = schedule()
        if plan is not None:
            plans.append(plan)
        return plan

    core.scheduler.schedule = spy
    return core, plans


def _run(overrides: dict, requests):
    core, plans = _engine(overrides)
    return asyncio.run(collect(core, requests)), core, plans


def _check_budget(plans: list[StepPlan], budget: int | None) -> None:
    if budget is not None:
        assert max(p.num_tokens for p in plans) <= budget


def _no_blocks_held(core) -> None:
    runners = [core.stages.verifier.runner]
    if hasattr(core.stages.proposer, "runner"):
        runners.append(core.stages.proposer.runner)
    for runner in runners:
        runner.cache.blocks.check()
        assert not runner.cache.blocks.tables and runner.num_free() == runner.num_slots


@pytest.fixture(scope="module")
def reference():
    reqs = _requests(6)
    out, _, _ = _run({"draft": "none", "max_num_batched_tokens": None,
                      "enable_prefix_caching": False}, reqs)
    return reqs, {rid: c.token_ids for rid, c in out.items()}


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("draft", ["ngram", "suffix", "model"])
def test_greedy_output_is_the_same_at_every_chunk_budget(reference, draft, caching):
    reqs, want = reference
    for budget in BUDGETS:
        out, core, plans = _run({"draft": draft, "enable_prefix_caching": caching,
                                 "max_num_batched_tokens": budget}, reqs)
        assert {rid: c.token_ids for rid, c in out.items()} == want, (draft, caching, budget)
        _check_budget(plans, budget)
        if budget == 16:  # prompts really were cut, and some chunks continued a prefill
            assert any(p.prefills for p in plans)
            assert any(n.chunk is not None for p in plans for n in p.new)
        if caching and budget in (16, 64):  # admitted one after another: the shared prefix hits
            assert core.stats.prefix_hits > 0
        for c in out.values():  # the first token came from the prefill: statistics add up
            assert len(c.token_ids) == 1 + c.last.spec_verify_ct + c.last.spec_accepted_tokens
        _no_blocks_held(core)


def test_a_request_drafts_and_verifies_only_after_its_last_chunk(reference):
    reqs, want = reference
    out, _, plans = _run({"draft": "ngram", "max_num_batched_tokens": 16}, reqs)
    assert {rid: c.token_ids for rid, c in out.items()} == want
    done: set[str] = set()  # rids whose prefill's last chunk ran
    lengths = {rid: len(p) for rid, p, _ in reqs}
    for plan in plans:
        assert not set(plan.decode) & (set(plan.prefills) | {n.rid for n in plan.new})
        assert set(plan.decode) <= done
        for rid, end in zip(plan.prefills, plan.prefill_ends):
            if end == lengths[rid]:
                done.add(rid)
        for n in plan.new:  # a first chunk may end the prompt (a cache hit helps)
            if n.chunk is None or n.chunk >= lengths[n.rid]:
                done.add(n.rid)
        done |= set(plan.decode)


def test_preemption_with_a_tiny_pool_and_chunked_recompute_matches_a_full_pool(reference):
    reqs, want = reference
    out, core, plans = _run({"draft": "model", "kv_cache_tokens": 256,
                             "max_num_batched_tokens": 16}, reqs)
    assert core.scheduler.preemptions > 0
    # a resumed request's recompute (prompt + output so far) is chunked too
    assert any(n.num_output > 0 and n.chunk is not None for p in plans for n in p.new)
    assert {rid: c.token_ids for rid, c in out.items()} == want
    _check_budget(plans, 16)
    for c in out.values():
        assert len(c.token_ids) == 1 + c.last.spec_verify_ct + c.last.spec_accepted_tokens
    _no_blocks_held(core)


def test_grammar_constrained_first_token_is_masked_after_a_chunked_prompt():
    from pipeline.grammar.llg import compile_grammar
    from pipeline.models.runners import tiny_tokenizer

    regex = r"[a-z]{2,6}-[0-9]{2}"

    tok = tiny_tokenizer()
    rng = random.Random(5)
    reqs = [(f"g{i}", [rng.randrange(3, 250) for _ in range(90 + 17 * i)],
             SamplingParams(max_new_tokens=24, grammar=compile_grammar("regex", regex, tok)))
            for i in range(3)]
    runs = {budget: _run({"draft": "ngram", "max_num_batched_tokens": budget}, reqs)
            for budget in (16, None)}
    for rid, _, _ in reqs:
        chunked, whole = runs[16][0][rid], runs[None][0][rid]
        assert chunked.token_ids == whole.token_ids
        assert chunked.finish_reason == "stop"
        assert re.fullmatch(regex, chunked.text), chunked.text


def test_aborting_a_request_mid_prefill_frees_everything_and_others_finish(reference):
    reqs, want = reference
    core, plans = _engine({"draft": "model", "max_num_batched_tokens": 16})
    long = [7 + i % 200 for i in range(230)]

    async def main():
        core.start()
        stream = await core.add_request(EngineCall("long", long, SamplingParams(max_new_tokens=5)))
        while not any("long" in p.prefills for p in plans):  # its second chunk is planned
            await asyncio.sleep(0.001)
        assert core.scheduler.running["long"].prefilling
        await core.abort("long")
        deltas = [d async for d in stream]
        others = await collect(core, reqs[:2])
        await core.idle()
        return deltas, others

    deltas, others = asyncio.run(main())
    assert [d.finish_reason for d in deltas] == ["abort"] and not deltas[0].token_ids
    assert {rid: c.token_ids for rid, c in others.items()} == {r: want[r] for r in ("r0", "r1")}
    assert not any(r.prefilling for r in core.stages.verifier._requests.values())
    _no_blocks_held(core)


def test_eight_long_prompts_arriving_while_streams_run_all_complete_without_a_stall():
    """Eight ~1,900-token prompts (max_model_len 2048, KV for all) arrive while four streams
    decode: every request completes, no step is declared stalled, none is over the budget, and
    the streams keep getting tokens while the prompts are prefilled."""
    budget = 256
    core, plans = _engine({"draft": "ngram", "max_model_len": 2048, "num_slots": 12,
                           "max_num_batched_tokens": budget, "step_timeout_s": 30})
    rng = random.Random(7)
    streams = [(f"s{i}", [rng.randrange(3, 250) for _ in range(20)],
                SamplingParams(max_new_tokens=150, ignore_eos=True)) for i in range(4)]
    longs = [(f"long{i}", [rng.randrange(3, 250) for _ in range(1850 + 10 * i)],
              SamplingParams(max_new_tokens=1, ignore_eos=True)) for i in range(8)]

    async def one(rid, prompt, params) -> Completion:
        stream = await core.add_request(EngineCall(rid, prompt, params))
        return Completion.fold([d async for d in stream])

    async def main():
        core.start()
        running = [asyncio.create_task(one(*r)) for r in streams]
        while core.stats.steps < 3:  # the streams are decoding
            await asyncio.sleep(0.001)
        out = await asyncio.gather(*running, *(one(*r) for r in longs))
        await core.idle()
        return out, core.health()

    out, health = asyncio.run(main())
    assert [len(c.token_ids) for c in out] == [150] * 4 + [1] * 8
    assert core.stats.stalls == 0 and core.dead_reason is None and health["healthy"]
    _check_budget(plans, budget)
    # the eight prompts (~15,000 tokens) took many steps, and the streams ran through them
    prefill_steps = [p for p in plans if p.new or p.prefills]
    assert len(prefill_steps) >= 8 * 1850 // budget
    assert sum(1 for p in prefill_steps if p.decode) >= len(prefill_steps) // 2
    _no_blocks_held(core)


def test_the_verifier_refuses_a_chunk_that_does_not_continue_its_prefill():
    from pipeline.models.runners import build_runner
    from pipeline.verify.verifier import Verifier

    verifier = Verifier(build_runner(load_config(CONFIG, {"draft": "none"}), "target"))
    prompt = list(range(3, 43))
    out = verifier.step(StepPlan(0, new=[NewRequest("a", prompt, SamplingParams(), chunk=16)]),
                        None)
    assert out.rids == [] and out.cached == [0]  # no token before the last chunk
    with pytest.raises(ValueError, match=r"chunk \[10, 20\) of 'a' does not continue"):
        verifier.step(StepPlan(1, prefills=["a"], prefill_starts=[10], prefill_ends=[20]), None)
    with pytest.raises(ValueError, match="no prefill under way"):
        verifier.step(StepPlan(1, prefills=["b"], prefill_starts=[0], prefill_ends=[20]), None)
    out = verifier.step(StepPlan(2, prefills=["a"], prefill_starts=[16], prefill_ends=[40]), None)
    assert out.rids == ["a"] and len(out.tokens[0]) == 1 and out.drafted == [0]


# --- the scheduler, as a property -------------------------------------------------------------
@st.composite
def workloads(draw):
    budget = draw(st.integers(4, 64))
    k = draw(st.integers(0, 4))
    reqs = [(draw(st.integers(1, 120)), draw(st.integers(1, 40)))
            for _ in range(draw(st.integers(1, 8)))]
    arrivals = [draw(st.integers(0, 6)) for _ in reqs]
    return budget, k, reqs, arrivals, draw(st.randoms(use_true_random=False))


@settings(max_examples=150, deadline=None)
@given(workloads(), st.sampled_from([None, 24]))
def test_every_plan_fits_the_budget_and_every_prompt_token_is_prefilled_once(work, blocks):
    """A simulated stage (random prefix-cache hits on whole blocks, random acceptance) under the
    scheduler: every plan's tokens fit the budget whenever its verify rows alone can (one each);
    each admission's chunks cover its prompt from the cache hit to the end exactly once, in
    order; a request verifies only after the chunk that ended its prompt; all complete."""
    budget, k, reqs, arrivals, rng = work
    sched = Scheduler(max_running=4, max_waiting=64, max_model_len=256,
                      num_speculative_tokens=k, vocab_size=300, num_blocks=blocks,
                      block_size=8, token_budget=budget)
    held: dict[str, int] = {}  # what the stage's KV holds of the current prefill
    length: dict[str, int] = {}
    done: set[str] = set()  # prefill finished (the last chunk ran)
    finished: set[str] = set()
    step = 0
    while len(finished) < len(reqs):
        for i, (n, out) in enumerate(reqs):
            if arrivals[i] == step:
                sched.enqueue(sched.prepare(EngineCall(f"r{i}", [5] * n, SamplingParams(
                    max_new_tokens=out, ignore_eos=True))))
        step += 1
        assert step < 5000, "no progress"
        plan = sched.schedule()
        if plan is None:
            continue
        if len(plan.decode) <= budget:
            assert plan.num_tokens <= budget
        for rid in plan.release:
            held.pop(rid, None)
            done.discard(rid)
        assert set(plan.decode) <= done
        rows, cached = [], []
        for new in plan.new:
            size = len(new.prompt_ids)
            hit = rng.randrange(0, (size - 1) // 8 + 1) * 8 if size > 1 else 0
            cached.append(hit)
            held[new.rid] = size if new.chunk is None else min(size, hit + new.chunk)
            length[new.rid] = size
            assert held[new.rid] > hit
        for rid, start, end in zip(plan.prefills, plan.prefill_starts, plan.prefill_ends):
            assert start == held[rid] < end <= length[rid]  # continues exactly where it was
            held[rid] = end
        for rid in [n.rid for n in plan.new] + plan.prefills:
            if held[rid] == length[rid]:
                assert rid not in done
                done.add(rid)
                rows.append((rid, [7], 0))
        for rid, kk in zip(plan.decode, plan.ks):
            rows.append((rid, [7] * rng.randint(1, kk + 1), kk))
        sched.apply(StepOutcome(plan.step, [r for r, _, _ in rows], [t for _, t, _ in rows],
                                [d for _, _, d in rows], cached=cached))
        for rid, _, _ in rows:
            req = sched.running.get(rid)
            if req is not None and req.num_output >= req.params.max_new_tokens:
                sched.finish(rid)
                finished.add(rid)


def test_verify_rows_alone_over_the_budget_have_their_drafts_cut_to_fit():
    sched = Scheduler(max_running=4, max_waiting=8, max_model_len=256, num_speculative_tokens=4,
                      vocab_size=300, token_budget=7)
    for i in range(3):
        sched.enqueue(sched.prepare(EngineCall(f"r{i}", [5, 6], SamplingParams(max_new_tokens=50))))
    plan = sched.schedule()
    assert [len(n.prompt_ids) for n in plan.new] == [2, 2, 2] and plan.num_tokens == 6
    sched.apply(StepOutcome(plan.step, plan.rids, [[9]] * 3, [0] * 3, cached=[0] * 3))
    plan = sched.schedule()
    assert plan.decode == ["r0", "r1", "r2"] and plan.num_tokens == 7  # caps 4,4,4 -> 2,1,1
    assert sorted(plan.caps) == [1, 1, 2]


def test_waiting_prompts_get_at_least_half_the_budget_from_drafting_streams():
    """16 streams at k 4 would fill a 64-token budget with verify rows; a newcomer waits, so
    their drafts shrink to leave it half the budget (each stream keeps its own token)."""
    sched = Scheduler(max_running=17, max_waiting=32, max_model_len=256, num_speculative_tokens=4,
                      vocab_size=300, token_budget=64)
    for i in range(16):
        sched.enqueue(sched.prepare(EngineCall(f"r{i}", [5, 6], SamplingParams(max_new_tokens=50))))
    plan = sched.schedule()
    sched.apply(StepOutcome(plan.step, plan.rids, [[9]] * 16, [0] * 16, cached=[0] * 16))
    assert sched.schedule().num_tokens == 64  # nobody waits: verify rows take the budget
    sched.apply(StepOutcome(1, [f"r{i}" for i in range(16)], [[9]] * 16, [0] * 16))
    sched.enqueue(sched.prepare(EngineCall("late", [7] * 100, SamplingParams(max_new_tokens=5))))
    plan = sched.schedule()
    assert len(plan.decode) == 16 and sum(1 + c for c in plan.caps) == 32
    assert [(n.rid, n.chunk) for n in plan.new] == [("late", 32)]


# --- the messages -----------------------------------------------------------------------------
CHUNKED = StepPlan(step=3, new=[NewRequest("n", list(range(1, 40)), SamplingParams(), chunk=16)],
                   prefills=["p", "q"], prefill_starts=[16, 0], prefill_ends=[32, 5],
                   decode=["d"], last_tokens=[4], kv_lens=[9], num_outputs=[2], ks=[3])


def test_a_plan_with_prefill_chunks_crosses_the_codec_unchanged():
    assert decode_plan(encode_plan(CHUNKED)) == CHUNKED
    assert decode_new_request(encode_new_request(CHUNKED.new[0])).chunk == 16
    assert CHUNKED.rids == ["n", "p", "q", "d"]
    assert CHUNKED.num_tokens == 16 + 16 + 5 + 4


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 5000)), max_size=6),
       st.none() | st.integers(1, 1 << 20))
def test_any_chunk_positions_round_trip(chunks, first):
    plan = StepPlan(step=1, new=[NewRequest("n", [1, 2], SamplingParams(), chunk=first)],
                    prefills=[f"p{i}" for i in range(len(chunks))],
                    prefill_starts=[s for s, _ in chunks],
                    prefill_ends=[s + n for s, n in chunks])
    assert decode_plan(encode_plan(plan)) == plan


def _tampered(**changes) -> bytes:
    msg = unpack(encode_plan(CHUNKED))
    msg.update(changes)
    return pack(msg)


def _i32(*values: int) -> bytes:
    return np.array(values, "<i4").tobytes()


@pytest.mark.parametrize(("changes", "needle"), [
    ({"pend": _i32(16, 5)}, r"prefill chunk of 'p' is empty or reversed \(\[16, 16\)\)"),
    ({"pst": _i32(40, 0)}, r"prefill chunk of 'p' is empty or reversed \(\[40, 32\)\)"),
    ({"pst": _i32(16)}, "plan.pst"),
    ({"pend": _i32(0, 5)}, "plan.pend"),
    ({"pre": ["p", "d"]}, "appears twice"),
    ({"pre": ["p", "n"]}, "appears twice"),
])
def test_malformed_prefill_chunks_are_protocol_errors(changes, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode_plan(_tampered(**changes))


@pytest.mark.parametrize("chunk", [0, -1, "8", 1.5])
def test_a_first_chunk_must_be_a_positive_count(chunk):
    msg = unpack(encode_new_request(NewRequest("n", [1, 2, 3], SamplingParams(), chunk=2)))
    msg["chunk"] = chunk
    with pytest.raises(ProtocolError, match="new.chunk"):
        decode_new_request(pack(msg))


def test_the_budget_is_validated_like_every_field():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        load_config(CONFIG, {"max_num_batched_tokens": 0})
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        load_config(CONFIG, {"max_num_batched_tokens": True})
    assert load_config(CONFIG, {"max_num_batched_tokens": None}).max_num_batched_tokens is None
