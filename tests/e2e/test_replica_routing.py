"""Routing matters (issue 44, must-show 2): 8 interleaved multi-turn conversations, each
re-sending a 512-token shared system prompt and its growing history every turn, over 2 engine
replicas. The prompt tokens served from the engines' prefix caches with `prefix` routing are at
least 0.9x those of a single replica, and clearly above `pow2` (which sends a conversation's
next turn to the replica holding its history only half the time). The answers are the same
whichever replica served each turn (greedy).

Token-id prompts on the tiny model (token i is the character chr(i), so an answer's text gives
back its ids exactly). Each round sends the 8 conversations' next turns at once."""

from __future__ import annotations

import asyncio
import json
import os
import random

import httpx
import pytest
from support.serve_helpers import ROOT, running_app

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
CONVERSATIONS, TURNS = 8, 5
SYSTEM_TOKENS, USER_TOKENS, ANSWER_TOKENS = 512, 256, 16
OVERRIDES = {"max_model_len": 2048, "num_slots": 8, "draft": "none", "max_waiting": 64}


def conversations_prompts(seed: int = 5) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 256) for _ in range(SYSTEM_TOKENS)]
    users = [[[rng.randrange(3, 256) for _ in range(USER_TOKENS)] for _ in range(TURNS)]
             for _ in range(CONVERSATIONS)]
    return system, users


async def run_conversations(base: str) -> tuple[dict[str, int], list[list[int]]]:
    """Cached and prompt tokens over all turns (usage); each conversation's final history."""
    system, users = conversations_prompts()
    history = [list(system) for _ in range(CONVERSATIONS)]
    cached = prompt = 0
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        for turn in range(TURNS):
            async def one(i: int, turn: int = turn) -> tuple[int, int]:
                history[i] += users[i][turn]
                r = await c.post("/v1/completions", json={
                    "model": "tiny", "prompt": history[i], "max_tokens": ANSWER_TOKENS,
                    "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200, r.text
                body = r.json()
                history[i] += [ord(ch) for ch in body["choices"][0]["text"]]
                usage = body["usage"]
                return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]
            for hit, total in await asyncio.gather(*(one(i) for i in range(CONVERSATIONS))):
                cached += hit
                prompt += total
    return {"cached_tokens": cached, "prompt_tokens": prompt}, history


def engine_hits(app: str) -> dict[str, int]:
    from ray import serve

    stats = serve.get_app_handle(app).engine_stats.remote().result(timeout_s=30)
    return {"prefix_cache_hits": stats["prefix_cache_hits"],
            "per_replica_steps": sorted(s.get("steps", 0) for s in stats["replicas"].values())}


def measure(name: str, deployment: dict) -> dict:
    with running_app({"config": TINY, "api_key": "", "overrides": OVERRIDES,
                      "deployment": deployment}, name=name) as base:
        result, history = asyncio.run(run_conversations(base))
        result.update(engine_hits(name))
    return result, history


def test_prefix_routing_keeps_the_cache_hits_of_one_replica_and_beats_pow2(ray_cluster):
    single, answers = measure("route-one", {"replicas": 1})
    prefix, prefix_answers = measure("route-prefix", {"replicas": 2, "routing": "prefix",
                                                      "imbalance_threshold": 4})
    # pow2's hits are 32 coin flips (which replica a turn lands on): two runs, their mean
    pow2_runs = [measure(f"route-pow2-{i}", {"replicas": 2, "routing": "pow2"}) for i in (0, 1)]
    pow2 = {"cached_tokens": sum(r["cached_tokens"] for r, _ in pow2_runs) / 2}
    # greedy: the same conversations whichever replica served each turn
    assert prefix_answers == answers and all(a == answers for _, a in pow2_runs)
    print("\nrouting: " + json.dumps({"single": single, "prefix": prefix,
                                     "pow2": [r for r, _ in pow2_runs]}))
    for r in (single, prefix, *(r for r, _ in pow2_runs)):
        # usage and the engines' own counters agree on what the caches served
        assert r["cached_tokens"] == r["prefix_cache_hits"], r
        assert r["prompt_tokens"] == single["prompt_tokens"]
    assert prefix["cached_tokens"] >= 0.9 * single["cached_tokens"]
    # pow2 sends a turn to the replica holding its history about half the time (a miss leaves
    # the history on both, so it loses less than half); one pow2 run measured 1.06-1.24x, the
    # mean of two 1.13-1.19x
    assert prefix["cached_tokens"] >= 1.05 * pow2["cached_tokens"], (prefix, pow2)
