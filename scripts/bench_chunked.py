"""Chunked prefill benchmark (issue 43, must-show 2), in process, on the shipped CPU config
(configs/smollm2-cpu.yaml, SmolLM2-135M) unless --config says otherwise.

    PYTHONPATH=. .venv/bin/python scripts/bench_chunked.py sweep   # how the default was chosen
    PYTHONPATH=. .venv/bin/python scripts/bench_chunked.py stall   # must-show 2

`sweep`: the target forward of one step holding 4 decoding streams' verify rows (1 + 4 drafts
each) alone, then with a prompt chunk of N tokens beside them (at prompt position 512, as in
the middle of a long prompt): the median milliseconds of each and its ratio to the decode-only
step. A budget keeps a step near a decode step's time when the chunk it leaves (budget - the
verify rows) costs a small multiple of it.

`stall`: 4 streams decode (n-gram drafting, greedy); once each has some tokens a ~1,100-token
prompt arrives. Per budget (the config's default, and none: the whole prompt in one step), the
worst gap between two deltas of a running stream against the streams' median gap, and the long
prompt's time to first token. Prefix caching is off, so every run prefills the whole prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import sys
import time

import torch

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `scripts`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine
from pipeline.models.runners import build_runner
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall
from scripts.harness import median_time

STREAMS, DRAFTS = 4, 4


def _median_ms(fn, repeats: int) -> float:
    return median_time(fn, repeats) * 1000


def sweep(config_path: str, chunks: list[int], repeats: int) -> None:
    config = load_config(config_path, {"enable_prefix_caching": False})
    runner = build_runner(config, "target")
    rng = random.Random(0)
    vocab = runner.vocab_size
    streams = [runner.allocate() for _ in range(STREAMS)]
    runner.forward(streams, [[rng.randrange(vocab) for _ in range(200)] for _ in streams],
                   last_only=True)
    long = runner.allocate()
    prompt = [rng.randrange(vocab) for _ in range(512 + max(chunks))]
    runner.forward([long], [prompt[:512]], last_only=True)
    verify = [[rng.randrange(vocab) for _ in range(1 + DRAFTS)] for _ in streams]

    def step(chunk: int) -> None:
        slots, runs = list(streams), list(verify)
        if chunk:
            slots.append(long)
            runs.append(prompt[512:512 + chunk])
        runner.forward(slots, runs, last_only=[False] * STREAMS + [True] * bool(chunk))
        for slot in streams:  # roll the verify rows back, as a rejected draft would be
            runner.truncate(slot, 200)
        runner.truncate(long, 512)

    step(0)  # warm-up
    base = _median_ms(lambda: step(0), repeats)
    rows = STREAMS * (1 + DRAFTS)
    print(f"decode-only step ({STREAMS} streams x (1 + {DRAFTS}) = {rows} tokens): {base:.0f} ms")
    for chunk in chunks:
        ms = _median_ms(lambda c=chunk: step(c), repeats)
        print(f"  + chunk {chunk:4d} (step budget {rows + chunk:4d}): {ms:6.0f} ms "
              f"= {ms / base:4.1f}x the decode step", flush=True)


async def _run_once(core, vocab: int, prompt_len: int, out_len: int,
                    arrivals: dict[str, list[float]]) -> tuple[float, float]:
    """4 streams, then the long prompt once each stream has 8 deltas; (sent, its TTFT)."""
    rng = random.Random(1)
    params = SamplingParams(max_new_tokens=out_len, ignore_eos=True)

    async def one(rid: str, prompt: list[int], p: SamplingParams) -> None:
        times = arrivals.setdefault(rid, [])
        async for _ in await core.add_request(EngineCall(rid, prompt, p)):
            times.append(time.perf_counter())

    core.start()
    tasks = [asyncio.create_task(one(f"s{i}", [rng.randrange(vocab) for _ in range(40)], params))
             for i in range(STREAMS)]
    while min(len(arrivals.get(f"s{i}", [])) for i in range(STREAMS)) < 8:
        await asyncio.sleep(0.005)
    sent = time.perf_counter()
    await one("long", [rng.randrange(vocab) for _ in range(prompt_len)],
              SamplingParams(max_new_tokens=1, ignore_eos=True))
    ttft = arrivals["long"][0] - sent
    await asyncio.gather(*tasks)
    await core.idle()
    await core.stop()
    return sent, ttft


def stall(config_path: str, budgets: list[int | None], prompt_len: int, out_len: int) -> None:
    base = load_config(config_path, {"enable_prefix_caching": False})
    runner = build_runner(base, "target")
    budgets = budgets or [base.max_num_batched_tokens, None]
    for budget in budgets:
        core = build_local_engine(base.replace(max_num_batched_tokens=budget), runner=runner)
        arrivals: dict[str, list[float]] = {}
        sent, ttft = asyncio.run(_run_once(core, runner.vocab_size, prompt_len, out_len,
                                           arrivals))
        gaps, around, outside = [], [], []
        for i in range(STREAMS):
            for a, b in itertools.pairwise(arrivals[f"s{i}"]):
                gaps.append(b - a)
                # while the long prompt was prefilled (or the step after), or not: the latter
                # shows what a shared machine's noise alone does to the worst gap
                (around if b >= sent and a <= sent + ttft + 1.0 else outside).append(b - a)
        med = statistics.median(gaps)
        p90 = statistics.quantiles(gaps, n=10)[-1]
        print(f"budget {budget!s:>5}: median gap {med * 1000:5.0f} ms (p90 {p90 * 1000:.0f}), "
              f"worst {max(gaps) * 1000:6.0f} ms = {max(gaps) / med:4.1f}x the median; worst "
              f"while prefilling {max(around, default=0) * 1000:6.0f} ms, elsewhere "
              f"{max(outside, default=0) * 1000:6.0f} ms; long prompt ({prompt_len} tokens) "
              f"TTFT {ttft:.2f} s; steps {core.stats.steps}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["sweep", "stall"])
    ap.add_argument("--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--chunks", default="32,64,128,192,256,384,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budgets", default="", help="comma list; 'none' = no budget "
                    "(default: the config's, then none)")
    ap.add_argument("--prompt-len", type=int, default=1100)
    ap.add_argument("--out-len", type=int, default=120)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a shared CPU's other load does not make them spin)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode == "sweep":
        sweep(args.config, [int(c) for c in args.chunks.split(",")], args.repeats)
    else:
        budgets = [None if b == "none" else int(b) for b in args.budgets.split(",") if b]
        stall(args.config, budgets, args.prompt_len, args.out_len)


if __name__ == "__main__":
    main()
