"""No leak (the issue's must-show 6): 10,000 requests through shared prefixes (in-process tiny
engine, 32 clients in closed loop, a pool small enough for evictions and preemptions, n-gram
drafting). At the end, on the target's pool: free + cached + in-use blocks == the pool, every
ref count 0, no block table left, the cache index within the pool; the pool's tensors are the
same tensors (same storage, same bytes) as at the start; and no per-request state is left in
the engine, the verifier or the output processor."""

from __future__ import annotations

import asyncio
import random

import pytest

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine
from pipeline.output.request_output import Completion
from pipeline.params import SamplingParams
from pipeline.protocol import EngineCall

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread")]

REQUESTS = 10_000
CLIENTS = 32


def _pool_state(runner) -> tuple:
    cache = runner.cache
    return tuple((t.data_ptr(), tuple(t.shape), t.nbytes) for t in cache.k + cache.v)


async def _soak(core, n: int, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 250) for _ in range(rng.randrange(20, 90))] for _ in range(12)]
    counts = {"done": 0, "tokens": 0}
    next_id = iter(range(n))

    async def client() -> None:
        for i in next_id:
            prompt = rng.choice(systems) + [rng.randrange(3, 250)
                                            for _ in range(rng.randrange(1, 24))]
            longest = 48 if i % 8 == 0 else 8  # a few long ones make the pool run out
            params = SamplingParams(max_new_tokens=rng.randrange(1, longest), ignore_eos=True)
            stream = await core.add_request(EngineCall(f"s{i}", prompt, params))
            done = Completion.fold([d async for d in stream])
            assert done.last.finish_reason == "length"
            assert len(done.token_ids) == params.max_new_tokens
            counts["done"] += 1
            counts["tokens"] += len(done.token_ids)

    core.start()
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    await core.idle()
    await core.stop()
    return counts


@pytest.mark.slow
def test_ten_thousand_requests_through_shared_prefixes_leak_no_block():
    config = load_config("configs/tiny.yaml", {
        "attention_backend": "sdpa", "draft": "ngram", "max_num_seqs": 32,
        "kv_cache_tokens": 640})  # 40 blocks for 32 requests: evictions and preemptions
    core = build_local_engine(config)
    runner = core.stages.verifier.runner
    start = _pool_state(runner)
    counts = asyncio.run(_soak(core, REQUESTS))
    assert counts["done"] == REQUESTS
    s = core.stats
    assert s.prefix_hits > 0.3 * s.prefix_queries  # the prefixes were shared
    assert core.scheduler.preemptions > 0  # the pool ran out, and was refilled
    blocks = runner.cache.blocks
    blocks.check()  # ref counts == tables, free list == unreferenced, index == keys
    assert not blocks.tables and blocks.ref_counts == [0] * blocks.num_blocks
    in_use = sum(1 for r in blocks.ref_counts if r)
    uncached_free = blocks.num_free - blocks.num_cached_free
    assert uncached_free + blocks.num_cached_free + in_use == blocks.num_blocks
    assert 0 < blocks.num_cached_free and len(blocks._cached) == blocks.num_cached_free
    assert runner.num_free() == runner.num_slots
    assert _pool_state(runner) == start  # the pool was never reallocated or grown
    # no per-request state anywhere
    assert not core.scheduler.running and not core.scheduler.waiting
    assert not core._streams and not core._cached and not core._unreleased
    assert not core.stages.verifier._requests
    assert core.stages.output.num_requests == 0
