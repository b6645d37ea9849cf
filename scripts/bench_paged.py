"""Paged KV benchmark: 32 requests of 200-token prompts + 64 output tokens (tiny model,
in-process engine, one torch thread) at today's KV memory (8 x 2048 tokens), with 8 slots (as
before paging) against max_num_seqs 32. Prints tokens/s, the most requests running at once and
the step count per setting.

    PYTHONPATH=. .venv/bin/python scripts/bench_paged.py [none|ngram|suffix|model]
"""

from __future__ import annotations

import asyncio
import os
import random
import sys

import torch

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `scripts`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.config import load_config
from pipeline.engine.core import EngineCore
from pipeline.engine.local import build_local_engine, collect
from pipeline.params import SamplingParams
from scripts.harness import stopwatch

SETTINGS = [("8 slots (before paging)", {"num_slots": 8}),
            ("max_num_seqs 32, same memory", {"num_slots": 8, "max_num_seqs": 32})]


def requests(n: int = 32, prompt_len: int = 200, out_len: int = 64) -> list:
    rng = random.Random(0)
    out = []
    for i in range(n):
        unit = [rng.randrange(3, 250) for _ in range(rng.randrange(4, 9))]
        out.append((f"r{i}", (unit * prompt_len)[:prompt_len],
                    SamplingParams(max_new_tokens=out_len, ignore_eos=True)))
    return out


def most_running(core: EngineCore) -> list[int]:
    """Record how many requests run at each plan."""
    seen: list[int] = []
    schedule = core.scheduler.schedule

    def spy():
        plan = schedule()
        seen.append(len(core.scheduler.running))
        return plan

    core.scheduler.schedule = spy
    return seen


def main(draft: str) -> None:
    torch.set_num_threads(1)
    reqs = requests()
    for label, over in SETTINGS:
        cfg = load_config("configs/tiny.yaml", {
            "draft": draft, "max_model_len": 2048, "attention_backend": "sdpa",
            "max_waiting": 64, **over})
        core = build_local_engine(cfg)
        seen = most_running(core)
        with stopwatch() as timing:
            out = asyncio.run(collect(core, reqs))
        took = timing.wall_s
        tokens = sum(len(c.token_ids) for c in out.values())
        print(f"{draft} {label}: {tokens} tokens in {took:.2f}s = {tokens / took:.0f} tok/s, "
              f"max running {max(seen)}, steps {core.stats.steps}, "
              f"kv blocks {core.scheduler.num_blocks}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "none")
