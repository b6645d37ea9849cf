"""The engine over the paged KV cache (in-process, tiny models): more requests in flight than
full-length rows when prompts are short, and preemption when the pool runs out mid-generation
(every request completes, each stream equals an unpreempted run, statistics add up, no block
leaks)."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine, collect
from pipeline.output.request_output import RequestOutput
from pipeline.params import SamplingParams

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"  # max_model_len 256, block_size 16, num_slots 8


def _requests(n: int, prompt_len: int, out_len: int, seed: int = 0):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        # repetitive prompts give n-gram drafting something to find
        unit = [rng.randrange(3, 250) for _ in range(rng.randrange(3, 7))]
        prompt = (unit * prompt_len)[: prompt_len - i % 5]
        reqs.append((f"r{i}", prompt, SamplingParams(max_new_tokens=out_len - i % 7,
                                                     ignore_eos=True)))
    return reqs


def _run(overrides: dict, requests):
    core = build_local_engine(load_config(CONFIG, {"attention_backend": "sdpa", **overrides}))
    most = []
    schedule = core.scheduler.schedule

    def spy():
        plan = schedule()
        most.append(len(core.scheduler.running))
        return plan

    core.scheduler.schedule = spy
    return asyncio.run(collect(core, requests)), core, max(most)


def _stages_hold_no_blocks(core) -> None:
    runners = [core.stages.verifier.runner]
    if hasattr(core.stages.proposer, "runner"):
        runners.append(core.stages.proposer.runner)
    for runner in runners:
        blocks = runner.cache.blocks
        blocks.check()
        assert blocks.num_free == blocks.num_blocks and not blocks.tables
        assert runner.num_free() == runner.num_slots


def test_short_requests_run_beyond_the_full_length_rows_in_the_same_memory():
    """The default pool (8 rows of max_model_len = 128 blocks) holds 32 requests of 40 + 24
    tokens at once when 32 may be in flight."""
    reqs = _requests(32, 40, 24)
    out, core, most = _run({"draft": "ngram", "max_num_seqs": 32}, reqs)
    ref, _, ref_most = _run({"draft": "none"}, reqs)
    assert most == 32 and ref_most == 8
    assert core.scheduler.num_blocks == 8 * 256 // 16
    for rid, _prompt, params in reqs:
        assert out[rid].token_ids == ref[rid].token_ids
        assert len(out[rid].token_ids) == params.max_new_tokens
    assert core.scheduler.preemptions == 0
    _stages_hold_no_blocks(core)


@pytest.mark.parametrize("draft", ["ngram", "model", "none"])
def test_preemption_with_a_tiny_pool_completes_every_request_as_an_unpreempted_run(draft):
    """A pool of 16 blocks (one max_model_len request) for 8 requests of ~40 + ~60 tokens: the
    newest are preempted and recomputed, again and again; every stream equals the run with a
    full pool, token for token, with nothing duplicated or missing, and its statistics add up."""
    reqs = _requests(8, 40, 60, seed=1)
    small, core, _ = _run({"draft": draft, "kv_cache_tokens": 256}, reqs)
    full, _, _ = _run({"draft": draft}, reqs)
    assert core.scheduler.preemptions > 0
    for rid, _prompt, params in reqs:
        got = small[rid]
        assert got.token_ids == full[rid].token_ids
        assert len(got.token_ids) == params.max_new_tokens
        assert got.last.finish_reason == "length"
        s = got.last
        assert len(got.token_ids) == 1 + s.spec_verify_ct + s.spec_accepted_tokens
    _stages_hold_no_blocks(core)


def _conversation(overrides: dict, turns: int = 4, seed: int = 3):
    """A multi-turn chat re-sending its whole history: a 100-token system prompt, then per turn
    a short user message and 12 output tokens. Returns per turn (prompt length, cached tokens,
    output ids) and the engine."""
    rng = random.Random(seed)
    core = build_local_engine(load_config(CONFIG, {"attention_backend": "sdpa", **overrides}))
    history = [rng.randrange(3, 250) for _ in range(100)]
    out = []

    async def talk():
        for turn in range(turns):
            history.extend(rng.randrange(3, 250) for _ in range(5 + turn))
            got = (await collect(core, [(f"t{turn}", list(history),
                                         SamplingParams(max_new_tokens=12, ignore_eos=True))]))
            done = got[f"t{turn}"]
            out.append((len(history), done.cached_tokens, done.token_ids))
            history.extend(done.token_ids)

    asyncio.run(talk())
    return out, core


@pytest.mark.parametrize("draft", ["ngram", "suffix", "model"])
def test_a_conversation_reuses_the_previous_turns_kv_and_says_so(draft):
    on, core = _conversation({"draft": draft})
    off, _core_off = _conversation({"draft": draft, "enable_prefix_caching": False})
    assert [o[2] for o in on] == [o[2] for o in off]          # identical greedy output
    assert [o[1] for o in off] == [0] * len(off)                # nothing cached when off
    assert on[0][1] == 0
    for (prev_len, _, prev_out), (_, cached, _) in itertools.pairwise(on):
        # every full block of the previous turn's prompt was cached, and the output's committed
        # blocks too (all but the last step's tokens)
        assert cached >= (prev_len // 16) * 16
        assert cached <= prev_len + len(prev_out)
    s = core.stats
    assert s.prefix_hits == sum(o[1] for o in on) and s.prefix_queries == sum(o[0] for o in on)
    _stages_hold_no_blocks(core)


def test_usage_reports_openai_cached_tokens_counting_each_prompt_once():
    from pipeline.frontend import responses as resp

    choices = [resp.ChoiceState(index=i) for i in range(4)]  # 2 prompts x n=2
    for c, cached in zip(choices, [32, 48, 0, 16]):
        c.add(RequestOutput(f"r{c.index}", token_ids=[1], cached_tokens=cached))
        c.add(RequestOutput(f"r{c.index}", token_ids=[2]))  # later deltas carry none
    assert choices[0].cached_tokens == 32
    cached = resp.cached_tokens(choices, num_prompts=2)
    assert cached == (32 + 48 + 0 + 16) // 2
    assert resp.usage(200, 8, cached)["prompt_tokens_details"] == {"cached_tokens": 48}
    assert "prompt_tokens_details" not in resp.usage(200, 8)
    chunk = resp.usage_chunk("id", "m", 0, "chat.completion.chunk", 200, 8, cached)
    assert chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 48


def test_prometheus_exports_prefix_cache_counters_and_kv_usage():
    from prometheus_client import generate_latest

    from pipeline.frontend.metrics import ServerMetrics

    metrics = ServerMetrics("tiny")
    registry = metrics.registry
    metrics.update_engine_stats({"prefix_cache_queries": 300, "prefix_cache_hits": 224,
                                 "kv_blocks": 128, "kv_blocks_used": 32, "preemptions": 2,
                                 "healthy": True})
    text = generate_latest(registry).decode()
    assert 'specrelay_prefix_cache_queries_total{model="tiny"} 300.0' in text
    assert 'specrelay_prefix_cache_hits_total{model="tiny"} 224.0' in text
    assert 'specrelay_kv_cache_usage_perc{model="tiny"} 0.25' in text
    assert 'specrelay_num_preemptions_total{model="tiny"} 2.0' in text
