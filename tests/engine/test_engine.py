"""The speculative engine in-process (no Ray): lossless greedy decoding, finish handling inside a
window, overlap, aborts, slot accounting, max_model_len, seeded sampling, failures."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from support.engine_cases import PROMPTS, TOK, expected_cut, ids, mixed_requests
from support.reference_decode import target_references

from pipeline.config import load_config
from pipeline.engine.core import EngineCore
from pipeline.engine.local import LocalStages, build_local_engine, collect
from pipeline.errors import EngineDeadError, EngineOverloadedError
from pipeline.params import SamplingParams
from pipeline.protocol import EngineCall

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"
# scripts/gpu_check.sh runs these on a GPU: SPECRELAY_TEST_DEVICE=cuda, SPECRELAY_TEST_DTYPE,
# SPECRELAY_TEST_BACKEND (flash needs a 16-bit dtype). Defaults: the CPU set of tiny.yaml.
PLACEMENT = {"device": os.environ.get("SPECRELAY_TEST_DEVICE", "cpu"),
             "dtype": os.environ.get("SPECRELAY_TEST_DTYPE", "float32"),
             "attention_backend": os.environ.get("SPECRELAY_TEST_BACKEND", "sdpa")}
# Spec and target-only logprobs come from different batch shapes: equal up to dtype rounding.
LOGPROB_TOL = 1e-4 if PLACEMENT["dtype"] == "float32" else 5e-2


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Target-only greedy continuations (60 tokens, no stop rules) of each prompt."""
    return target_references(CONFIG, PROMPTS, 60, PLACEMENT)


def run(overrides: dict, requests: list[tuple[str, list[int], SamplingParams]]):
    core = build_local_engine(load_config(CONFIG, {**PLACEMENT, **overrides}))
    return asyncio.run(collect(core, requests)), core


@pytest.mark.parametrize("draft", ["model", "ngram"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("overlap", [True, False])
def test_speculative_greedy_equals_target_only(draft, batch, overlap, reference):
    requests = mixed_requests(batch)
    spec, core = run({"draft": draft, "overlap": overlap}, requests)
    plain, _ = run({"draft": "none", "overlap": overlap}, requests)
    for rid, prompt, params in requests:
        want_ids, want_text = expected_cut(reference[PROMPTS.index(prompt)], params)
        assert plain[rid].token_ids == want_ids
        assert spec[rid].token_ids == want_ids
        assert spec[rid].text == plain[rid].text == want_text
        assert spec[rid].finish_reason == plain[rid].finish_reason
        assert spec[rid].matched_stop == plain[rid].matched_stop
        if params.logprobs is not None:
            assert spec[rid].logprobs == pytest.approx(plain[rid].logprobs, abs=LOGPROB_TOL)
    assert core.stats.draft_tokens > 0
    assert core.scheduler.free_slots == core.scheduler.max_running


@pytest.mark.skipif(PLACEMENT["device"] != "cpu", reason="int4 weights run on the CPU only")
@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_int4_speculative_greedy_equals_target_only(draft):
    """The lossless contract on 4-bit projections (torch's int4 kernel, bfloat16 inside)."""
    int4 = {**PLACEMENT, "quantization": "int4"}
    reference = target_references(CONFIG, PROMPTS, 60, int4)
    requests = mixed_requests(8)
    spec, core = run({**int4, "draft": draft}, requests)
    plain, _ = run({**int4, "draft": "none"}, requests)
    for rid, prompt, params in requests:
        want_ids, want_text = expected_cut(reference[PROMPTS.index(prompt)], params)
        assert spec[rid].token_ids == plain[rid].token_ids == want_ids
        assert spec[rid].text == plain[rid].text == want_text
        assert spec[rid].finish_reason == plain[rid].finish_reason
    assert core.stats.accepted_tokens > 0


def test_draft_model_accepts_some_but_not_all_drafts():
    _, core = run({"draft": "model", "speculation": "fixed"}, mixed_requests(8))
    s = core.stats
    assert 0.2 < s.accepted_tokens / s.draft_tokens < 0.8
    assert s.histogram[0] > 0 and s.histogram[-1] > 0 and len(s.histogram) == 5


def finish_mid_window_requests(ref: list[int]) -> list[tuple[str, list[int], SamplingParams]]:
    """Four requests on one prompt that end inside the first 5-token verify window (positions
    1..5, all drafts accepted with an identical draft): length at 3, stop id at its first
    occurrence, a stop string, and one that runs on."""
    stop_id = ref[4]
    stop_str = TOK.decode(ref[2:4])
    base = {"ignore_eos": True, "logprobs": 1}
    return [
        ("len3", PROMPTS[0], SamplingParams(max_new_tokens=3, **base)),
        ("stopid", PROMPTS[0], SamplingParams(max_new_tokens=40, stop_token_ids=[stop_id],
                                              **base)),
        ("stopstr", PROMPTS[0], SamplingParams(max_new_tokens=40, stop=[stop_str], **base)),
        ("long", PROMPTS[0], SamplingParams(max_new_tokens=23, **base)),
    ]


@pytest.mark.parametrize("overlap", [True, False])
def test_finishes_inside_one_window_end_exactly_and_emit_nothing_after(overlap, reference):
    ref = reference[0]
    requests = finish_mid_window_requests(ref)
    core = build_local_engine(load_config(CONFIG, {**PLACEMENT, "draft_agreement_noise": 0.0,
                                                   "overlap": overlap, "speculation": "fixed"}))
    deltas: dict[str, list] = {}

    async def main():
        core.start()

        async def one(rid, prompt, params):
            deltas[rid] = [d async for d in await core.add_request(EngineCall(rid, prompt, params))]

        await asyncio.gather(*(one(*r) for r in requests))
        await asyncio.sleep(0.05)  # let a late (overlapped) step drain
        return await core.stats_dict()

    stats = asyncio.run(main())
    for rid, _, params in requests:
        want_ids, want_text = expected_cut(ref, params)
        got = deltas[rid]
        assert [d.finished for d in got] == [False] * (len(got) - 1) + [True]
        assert ids(got) == want_ids
        assert "".join(d.text for d in got) == want_text
        assert sum(len(d.logprobs) for d in got) == len(want_ids)
        assert got[-1].finished_len == len(want_ids)
    assert deltas["len3"][-1].finish_reason == "length"
    assert deltas["stopid"][-1].matched_stop == ref[4]
    assert deltas["stopstr"][-1].matched_stop == TOK.decode(ref[2:4])
    # len3 / stopid / stopstr all finished in the first verify step
    assert {deltas[r][-1].finish_step for r in ("len3", "stopid", "stopstr")} == {1}
    assert stats["free_slots"] == stats["num_slots"] == 8
    stages = core.stages
    assert stages.verifier.runner.num_free() == 8 and stages.proposer.runner.num_free() == 8
    # With overlap the engine ran one more step for the two stop-finished requests before it
    # heard of their finish, and the output processor dropped those windows; the length-capped
    # one is never scheduled past its cap.
    assert stats["dropped_steps"] == (2 if overlap else 0)


@pytest.mark.parametrize("overrides", [{}, {"draft": "none", "async_scheduling": "on"}])
def test_abort_running_request_frees_slots(overrides):
    """Also between steps sent ahead (async scheduling)."""
    core = build_local_engine(load_config(CONFIG, overrides))

    async def main():
        core.start()
        stream = await core.add_request(EngineCall("a", PROMPTS[0], SamplingParams(
            max_new_tokens=200, ignore_eos=True)))
        other = await core.add_request(EngineCall("b", PROMPTS[1],
                                                  SamplingParams(max_new_tokens=5)))
        got = []
        async for d in stream:
            got.append(d)
            if len(got) == 3:
                await core.abort("a")
        rest = [d async for d in other]
        await asyncio.sleep(0.05)
        return got, rest

    got, rest = asyncio.run(main())
    assert got[-1].finished and got[-1].finish_reason == "abort"
    assert len(got) == 4 and not any(d.finished for d in got[:-1])
    assert rest[-1].finish_reason == "length" and len(ids(rest)) == 5
    assert core.scheduler.free_slots == 8
    # the releases reached the stages with a later (release-only) plan
    assert core.stages.verifier.runner.num_free() == 8
    if overrides:
        assert core.stats.steps_ahead > 0
    else:
        assert core.stages.proposer.runner.num_free() == 8


def test_200_requests_through_8_slots_complete_in_fifo_order(reference):
    requests = []
    for i in range(200):
        p = i % len(PROMPTS)
        requests.append((f"q{i}", PROMPTS[p], SamplingParams(max_new_tokens=1 + i % 9,
                                                             ignore_eos=True)))
    core = build_local_engine(load_config(CONFIG, {"max_waiting": 200}))
    admitted: list[str] = []
    schedule = core.scheduler.schedule

    def spy(*a, **kw):
        plan = schedule(*a, **kw)
        if plan is not None:
            admitted.extend(n.rid for n in plan.new)
            assert len(core.scheduler.running) <= 8
        return plan

    core.scheduler.schedule = spy
    out = asyncio.run(collect(core, requests))
    for rid, prompt, params in requests:
        assert out[rid].token_ids == reference[PROMPTS.index(prompt)][: params.max_new_tokens]
        assert out[rid].finish_reason == "length"
    assert admitted == [r[0] for r in requests]  # FIFO: nobody passed over
    assert core.scheduler.free_slots == 8 and not core.scheduler.waiting


def test_requests_admitted_while_others_decode_share_their_forward(reference):
    """Every step is one model forward, prompts and verify runs together (a forward's fixed cost
    paid once a step); a step that prefilled reports no decode time to the adaptive k's cost
    model (its forward is not what the decodes cost), a step of decodes alone does."""
    requests = [(f"q{i}", PROMPTS[i % len(PROMPTS)],
                 SamplingParams(max_new_tokens=3 + 4 * i, ignore_eos=True)) for i in range(6)]
    core = build_local_engine(load_config(CONFIG, {"num_slots": 3, "draft": "ngram"}))
    runner, verifier = core.stages.verifier.runner, core.stages.verifier
    forwards, steps = [], []
    forward, step = runner.forward, verifier.step

    def count_forward(*a, **kw):
        forwards.append(len(a[0]))
        return forward(*a, **kw)

    def record_step(plan, proposal):
        before = len(forwards)
        outcome = step(plan, proposal)
        steps.append((len(plan.new), len(plan.decode), len(forwards) - before, outcome.decode_s))
        return outcome

    runner.forward, verifier.step = count_forward, record_step
    out = asyncio.run(collect(core, requests))
    for rid, prompt, params in requests:
        assert out[rid].token_ids == reference[PROMPTS.index(prompt)][: params.max_new_tokens]
    work = [s for s in steps if s[0] or s[1]]  # not the release-only steps
    assert any(new and decode for new, decode, _, _ in work), "nobody joined running requests"
    assert [n for _, _, n, _ in work] == [1] * len(work)
    assert all(seconds is None for new, _, _, seconds in work if new)
    assert all(seconds > 0 for new, _, _, seconds in work if not new)


def test_generation_stops_at_max_model_len(reference):
    prompt = PROMPTS[6]
    out, _ = run({"max_model_len": 24}, [
        ("r", prompt, SamplingParams(max_new_tokens=100, ignore_eos=True))])
    assert out["r"].finish_reason == "length"
    assert len(out["r"].token_ids) == 24 - len(prompt)
    assert out["r"].token_ids == reference[6][: 24 - len(prompt)]


def test_seeded_sampling_is_reproducible_through_the_speculative_engine():
    def sample(batch_extra: int):
        reqs = [("s", PROMPTS[3], SamplingParams(max_new_tokens=30, temperature=0.8, top_k=50,
                                                  top_p=0.95, seed=1234, ignore_eos=True))]
        reqs += [(f"x{i}", PROMPTS[i], SamplingParams(max_new_tokens=10, temperature=1.0))
                 for i in range(batch_extra)]
        out, _ = run({"draft": "model"}, reqs)
        return out["s"].token_ids

    first = sample(0)
    assert sample(0) == first
    assert sample(3) == first  # independent of the batch it shares
    other = run({"draft": "model"}, [("s", PROMPTS[3], SamplingParams(
        max_new_tokens=30, temperature=0.8, top_k=50, top_p=0.95, seed=99,
        ignore_eos=True))])[0]["s"].token_ids
    assert other != first and len(first) == 30


SEEDED = SamplingParams(max_new_tokens=40, temperature=0.5, top_k=50, top_p=0.95, seed=7,
                        ignore_eos=True)


def seeded_phases(draft: str, speculation: str) -> tuple[list[list[int]], int]:
    """One engine drafting with `draft`: the seeded request alone, after other traffic (the
    same prompt, same and other seeds, other prompts: what a suffix index learns from), and
    during it. Its token ids in each phase, and the drafts proposed for it."""
    core = build_local_engine(load_config(CONFIG, {**PLACEMENT, "draft": draft, "ngram_min_n": 1,
                                                   "speculation": speculation}))
    prompt = PROMPTS[0]
    traffic = [(f"t{i}", prompt, SamplingParams(max_new_tokens=40, temperature=0.5, seed=i,
                                                ignore_eos=True)) for i in (7, 8, 9)]
    traffic += [(f"u{i}", PROMPTS[i], SamplingParams(max_new_tokens=20, temperature=1.0))
                for i in (1, 3, 6)]

    def phase(tag: str, others: list) -> tuple[list[int], int]:
        rename = [(f"{tag}-{rid}", p, params) for rid, p, params in others]
        out = asyncio.run(collect(core, [(tag, prompt, SEEDED)] + rename))
        return out[tag].token_ids, out[tag].last.spec_draft_tokens

    alone, d1 = phase("alone", [])
    asyncio.run(collect(core, traffic))
    after, d2 = phase("after", [])
    during, d3 = phase("during", traffic)
    return [alone, after, during], d1 + d2 + d3


def test_seeded_request_reproduces_alone_after_and_during_traffic_whatever_the_drafts():
    # docs/contracts.md, *Seeds*: a position's randomness depends on (seed, position) only, so
    # neither the drafter (its drafts depend on other traffic under suffix drafting) nor k changes
    # a token
    runs = {(draft, spec): seeded_phases(draft, spec)
            for draft in ("none", "ngram", "suffix", "model") for spec in ("fixed", "adaptive")
            if draft != "none" or spec == "fixed"}
    expected = runs["none", "fixed"][0][0]
    assert len(expected) == 40
    for (draft, spec), (phases, drafted) in runs.items():
        assert phases == [expected] * 3, (draft, spec)
        if spec == "fixed":
            assert (drafted > 0) == (draft != "none"), draft


def test_full_queue_raises_overloaded_before_queueing():
    core = build_local_engine(load_config(CONFIG, {"max_waiting": 2}))

    async def main():
        await core.add_request(EngineCall("a", [5], SamplingParams()))
        await core.add_request(EngineCall("b", [5], SamplingParams()))
        with pytest.raises(EngineOverloadedError):
            await core.add_request(EngineCall("c", [5], SamplingParams()))
        return core.scheduler.waiting

    assert [r.rid for r in asyncio.run(main())] == ["a", "b"]


class _BrokenStages(LocalStages):
    def __init__(self, inner: LocalStages, mode: str, fail_at: int = 3) -> None:
        super().__init__(inner.proposer, inner.verifier, inner.output)
        self.mode = mode
        self.steps = 0
        self.fail_at = fail_at

    async def run_step(self, plan):
        self.steps += 1
        if self.steps == self.fail_at:
            if self.mode == "raise":
                raise RuntimeError("verifier rank 1 died")
            await asyncio.sleep(30)  # a hung stage
        return await super().run_step(plan)


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_stage_failure_or_timeout_fails_requests_and_marks_unhealthy(mode):
    config = load_config(CONFIG, {"step_timeout_s": 0.5})
    inner = build_local_engine(config)
    core = EngineCore(config, _BrokenStages(inner.stages, mode), vocab_size=256)

    async def main():
        core.start()
        streams = [await core.add_request(EngineCall(f"r{i}", PROMPTS[i], SamplingParams(
            max_new_tokens=50, ignore_eos=True))) for i in range(3)]
        t0 = time.monotonic()
        errors = []
        for s in streams:
            with pytest.raises(EngineDeadError) as e:
                async for _ in s:
                    pass
            errors.append(str(e.value))
        elapsed = time.monotonic() - t0
        with pytest.raises(EngineDeadError):
            await core.add_request(EngineCall("late", [5], SamplingParams()))
        return errors, elapsed

    errors, elapsed = asyncio.run(main())
    assert elapsed < 3
    assert ("died" if mode == "raise" else "stalled") in errors[0]
    assert core.stats.stalls == (1 if mode == "hang" else 0)  # /metrics' stall detections
    health = core.health()
    assert health["healthy"] is False and health["reason"]


def test_engine_step_span_parents_the_output_verify_step_span():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pipeline.output.processor import OutputProcessor
    from pipeline.output.spans import TracedOutputProcessor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    config = load_config(CONFIG)
    local = build_local_engine(config).stages
    output = TracedOutputProcessor(OutputProcessor(TOK, [2]), tracer=tracer)
    core = EngineCore(config, LocalStages(local.proposer, local.verifier, output), 256, tracer)
    asyncio.run(collect(core, [("t", PROMPTS[0], SamplingParams(max_new_tokens=6))]))
    spans = exporter.get_finished_spans()
    engine_steps = {s.context.span_id: s for s in spans if s.name == "spec.engine_step"}
    verify_steps = [s for s in spans if s.name == "spec.verify_step"]
    assert verify_steps and len(verify_steps) == len(engine_steps)
    for s in verify_steps:
        parent = engine_steps[s.parent.span_id]
        assert parent.context.trace_id == s.context.trace_id
        assert parent.attributes["spec.step"] == s.attributes["spec.step"]


def test_request_refused_by_the_output_stage_fails_alone_before_queueing():
    core = build_local_engine(load_config(CONFIG))

    def broken_grammar():
        raise ValueError("grammar: cannot compile")

    async def main():
        core.start()
        with pytest.raises(ValueError, match="grammar"):
            await core.add_request(EngineCall("bad", PROMPTS[0],
                                              SamplingParams(grammar=broken_grammar)))
        stream = await core.add_request(EngineCall("bad", PROMPTS[0],
                                                   SamplingParams(max_new_tokens=4)))
        return [d async for d in stream], core.health()

    deltas, health = asyncio.run(main())
    assert deltas[-1].finish_reason in ("length", "stop") and health["healthy"]
    assert not core.scheduler.waiting and core.scheduler.free_slots == 8


def test_abort_while_the_output_stage_registers_never_queues_the_request():
    """A client gone before its request was registered (found by the soak): the request must not
    be queued afterwards, or it would run with no stream and hold its slot forever."""
    core = build_local_engine(load_config(CONFIG))
    stages = core.stages
    register = stages.add_request
    gate = asyncio.Event()

    async def slow_register(req, traceparent):
        await gate.wait()
        await register(req, traceparent)

    stages.add_request = slow_register

    async def main():
        core.start()
        adding = asyncio.ensure_future(
            core.add_request(EngineCall("gone", PROMPTS[0], SamplingParams(max_new_tokens=8))))
        await asyncio.sleep(0)  # add_request is now waiting on the output stage
        await core.abort("gone")
        gate.set()
        deltas = [d async for d in await adding]
        stages.add_request = register
        stream = await core.add_request(EngineCall("next", PROMPTS[1],
                                                   SamplingParams(max_new_tokens=4)))
        return deltas, [d async for d in stream]

    gone, after = asyncio.run(main())
    assert [d.finish_reason for d in gone] == ["abort"]
    assert after[-1].finished and sum(len(d.token_ids) for d in after) == 4
    assert not core.scheduler.running and not core.scheduler.waiting
    assert core.scheduler.free_slots == 8 and stages.output.num_requests == 0


def test_a_hang_after_fast_steps_is_declared_at_the_adaptive_bound_not_the_ceiling():
    """Once steps were timed, the stall bound is a multiple of their p99 (here at most a few
    seconds), far under the 600 s ceiling that holds before any step was timed."""
    config = load_config(CONFIG, {"step_timeout_s": 600, "step_timeout_floor_s": 0.5,
                                  "overlap": False})
    inner = build_local_engine(config)
    core = EngineCore(config, _BrokenStages(inner.stages, "hang", fail_at=30), vocab_size=256)
    assert core.stall_bound_s == 600

    async def main():
        core.start()
        stream = await core.add_request(EngineCall("r", PROMPTS[0], SamplingParams(
            max_new_tokens=240, ignore_eos=True)))  # >= 48 steps of at most 5 tokens
        with pytest.raises(EngineDeadError, match="stalled") as e:
            async for _ in stream:
                pass
        await core.stop()
        return str(e.value)

    error = asyncio.run(main())
    assert core.stall_bound_s < 60, error
    assert core.health()["healthy"] is False


def test_a_closed_loop_client_refills_a_finished_slot_at_the_next_step():
    """A step runs off the event loop (as a Ray stage does), so a client that submits its next
    request when it sees a finish is admitted a step after the finish arrives. Run on the loop,
    a step blocked it, and the slot stayed empty for several steps (chat at batch 8: ~45 of 258
    steps a wave at batch 3-7)."""
    core = build_local_engine(load_config(CONFIG, {"num_slots": 2}))
    verifier_step = core.stages.verifier.step

    def slow_step(plan, proposal):  # a forward's duration; sleeping releases the GIL as it does
        time.sleep(0.02)
        return verifier_step(plan, proposal)

    core.stages.verifier.step = slow_step
    plans = []
    schedule = core.scheduler.schedule

    def spy():
        plan = schedule()
        if plan is not None and plan.rids:
            plans.append(([n.rid for n in plan.new], list(plan.decode)))
        return plan

    core.scheduler.schedule = spy
    lengths = {"short": 3, "long": 14, "next": 4}

    async def main():
        gate = asyncio.Semaphore(2)

        async def one(rid: str) -> None:
            async with gate:
                stream = await core.add_request(EngineCall(rid, PROMPTS[0], SamplingParams(
                    max_new_tokens=lengths[rid], ignore_eos=True)))
                async for _ in stream:
                    pass

        core.start()
        await asyncio.gather(*(one(rid) for rid in lengths))
        await core.idle()

    asyncio.run(main())
    last_decode = max(i for i, (_, decode) in enumerate(plans) if "short" in decode)
    admitted = next(i for i, (new, _) in enumerate(plans) if "next" in new)
    # with overlap the finish reaches the client during the step after the short one's last
    # decode; its successor joins the step after that
    assert admitted - last_decode <= 2, plans


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_a_request_id_reused_right_after_a_stop_gets_none_of_the_old_requests_tokens(
        draft, reference):
    """A stop is found by the output stage, so with overlap on the step after it was already
    planned with the stopped request. A client that reuses the id as soon as it sees the finish
    must not receive that step's tokens: they belong to the old request (TP = 2 on Ray once
    streamed the stopped request's next token as the new one's first)."""
    ref = reference[6]
    stop = next(p for p in range(4, len(ref)) if ref[p] not in ref[:p])
    core = build_local_engine(load_config(CONFIG, {**PLACEMENT, "draft": draft}))
    plans = []
    schedule = core.scheduler.schedule

    def spy():
        plan = schedule()
        if plan is not None:
            plans.append(([n.rid for n in plan.new], list(plan.release)))
        return plan

    core.scheduler.schedule = spy

    async def main():
        core.start()
        outs = []
        for params in (SamplingParams(max_new_tokens=40, stop_token_ids=[ref[stop]]),
                       SamplingParams(max_new_tokens=6, ignore_eos=True)):
            stream = await core.add_request(EngineCall("same", PROMPTS[6], params))
            outs.append([d async for d in stream])
        await core.idle()
        return outs

    first, second = asyncio.run(main())
    assert ids(first) == ref[:stop + 1] and first[-1].finish_reason == "stop"
    assert ids(second) == ref[:6] and second[-1].finish_reason == "length"
    # the case this covers happened: a step carried the stopped request after its stop, and
    # the output stage dropped it whole; the new request was admitted only after the release
    assert asyncio.run(core.stages.dropped_steps()) >= 1
    admitted = [i for i, (new, _) in enumerate(plans) if "same" in new]
    released = next(i for i, (_, release) in enumerate(plans) if "same" in release)
    assert len(admitted) == 2 and admitted[1] > released
    assert core.scheduler.free_slots == core.scheduler.max_running


def test_fan_outs_filling_the_queue_never_refuse_a_single_small_request():
    # issue 42: 8 clients sending 64-choice requests filled the 256-place queue and a 4-token
    # request got 429 23 times in 47; the reserve (reserved_waiting) keeps places for it
    core = build_local_engine(load_config(CONFIG, {**PLACEMENT, "max_waiting": 256,
                                                   "draft": "ngram"}))
    fan = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True)
    small = SamplingParams(max_new_tokens=4, ignore_eos=True)
    refusals = {"fan": 0, "small": 0}
    latencies: list[float] = []

    async def drain(stream) -> None:
        async for _ in stream:
            pass

    async def fan_client(c: int) -> None:
        for attempt in range(1000):  # until cancelled: keep the queue full
            rids = [f"f{c}-{attempt}-{i}" for i in range(64)]
            streams = []
            try:
                for rid in rids:
                    call = EngineCall(rid, [5, 6, 7], fan, group=rids[0])
                    streams.append(await core.add_request(call))
            except EngineOverloadedError:
                refusals["fan"] += 1
                for rid in rids[: len(streams)]:
                    await core.abort(rid)
                await asyncio.sleep(0.005)
                continue
            await asyncio.gather(*(drain(s) for s in streams))

    async def small_client() -> None:
        for _ in range(500):  # until the fan-outs hold most places open to them (granular:
            if len(core.scheduler.waiting) >= 160:  # 64 at a time, minus admitted choices)
                break
            await asyncio.sleep(0.01)
        assert len(core.scheduler.waiting) >= 160
        for i in range(20):
            t0 = time.monotonic()
            try:
                stream = await core.add_request(EngineCall(f"s{i}", [9, 10], small))
            except EngineOverloadedError:
                refusals["small"] += 1
                continue
            out = [d async for d in stream]
            assert sum(len(d.token_ids) for d in out) == 4
            latencies.append(time.monotonic() - t0)

    async def main() -> None:
        core.start()
        fans = [asyncio.ensure_future(fan_client(c)) for c in range(8)]
        await small_client()
        for task in fans:
            task.cancel()
        await asyncio.gather(*fans, return_exceptions=True)
        await core.stop()

    asyncio.run(main())
    assert refusals["small"] == 0 and len(latencies) == 20
    assert refusals["fan"] > 0  # the queue was full for fan-outs meanwhile
    latencies.sort()
    print(f"small-request latency p50 {latencies[9]:.3f} s, max (p99) {latencies[-1]:.3f} s; "
          f"fan-out refusals {refusals['fan']}")


def test_health_follows_the_step_in_flight_not_the_gap_between_steps():
    """A busy engine between steps (handing out a big step's deltas, planning the next) is
    healthy however long that takes under the step timeout; a step running past its own bound
    is not, before the loop's own stall check ends it; nor is a loop that stopped stepping with
    work to do for the step timeout."""
    config = load_config(CONFIG, {"step_timeout_s": 30.0})
    core = build_local_engine(config)  # not started: its state is set by hand below

    async def main():
        await core.add_request(EngineCall("r", PROMPTS[0], SamplingParams()))
        assert core.scheduler.has_work
        core.stall_bound_s = 0.5
        core.last_progress -= 10.0  # 10 s since the last step ended, no step in flight
        between = core.health()
        core._step_started = time.monotonic() - 1.0  # a step running 1 s against 0.5
        stuck = core.health()
        core._step_started = None
        core.last_progress -= 30.0
        stopped = core.health()
        return between, stuck, stopped

    between, stuck, stopped = asyncio.run(main())
    assert between["healthy"] is True
    assert stuck["healthy"] is False and "over its bound" in stuck["reason"]
    assert stopped["healthy"] is False and "no progress" in stopped["reason"]
