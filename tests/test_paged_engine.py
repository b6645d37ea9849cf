"""The engine over the paged KV cache (in-process, tiny models): more requests in flight than
full-length rows when prompts are short, and preemption when the pool runs out mid-generation
(every request completes, each stream equals an unpreempted run, statistics add up, no block
leaks)."""

from __future__ import annotations

import asyncio
import random

import pytest

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine, collect
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
