"""Lossless under every drafter: greedy output with the prefix cache on (and a pool so small that
requests are preempted and recomputed, re-attaching cached blocks) equals the output with the
cache off and a full pool, for target-only, n-gram, suffix and model drafting (in-process, tiny
models). Requests share prefixes and arrive in two waves, so the second wave hits blocks the first
committed (prompt and output), while the first wave's stragglers still run."""

from __future__ import annotations

import asyncio
import random

import pytest

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine, collect
from pipeline.params import SamplingParams

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"  # block_size 16, max_model_len 256


def _wave(wave: int, n: int = 6) -> list:
    rng = random.Random(wave)
    systems = [[random.Random(s).randrange(3, 250) for _ in range(40 + 9 * s)] for s in range(2)]
    out = []
    for i in range(n):
        unit = [rng.randrange(3, 250) for _ in range(rng.randrange(3, 6))]
        prompt = systems[i % 2] + (unit * 8)[: 6 + 5 * i]  # repetitive: drafters find matches
        out.append((f"w{wave}-{i}", prompt,
                    SamplingParams(max_new_tokens=40 + 3 * i, ignore_eos=True)))
    return out


def _run(overrides: dict):
    core = build_local_engine(load_config(CONFIG, {"attention_backend": "sdpa", **overrides}))

    async def waves():
        first = asyncio.ensure_future(collect(core, _wave(0)))
        await asyncio.sleep(0.05)  # the second wave lands while the first still decodes
        second = await collect(core, _wave(1))
        return {**await first, **second}

    out = asyncio.run(waves())
    return {rid: c.token_ids for rid, c in out.items()}, core


@pytest.mark.parametrize("draft", ["none", "ngram", "suffix", "model"])
def test_greedy_output_is_the_same_with_the_cache_on_a_tiny_pool_and_the_cache_off(draft):
    on, core = _run({"draft": draft, "kv_cache_tokens": 256})  # 16 blocks: preemption
    off, core_off = _run({"draft": draft, "enable_prefix_caching": False})
    assert on == off
    assert core.stats.prefix_hits > 0 and core.scheduler.preemptions > 0
    assert core_off.stats.prefix_hits == 0
    for c in (core, core_off):
        runners = [c.stages.verifier.runner]
        if hasattr(c.stages.proposer, "runner"):
            runners.append(c.stages.proposer.runner)
        for runner in runners:
            runner.cache.blocks.check()
            assert not runner.cache.blocks.tables
