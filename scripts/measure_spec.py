"""Tokens/s and mean accepted length: SmolLM2 target-only vs n-gram drafting on a copy-heavy prompt
("rewrite this code with one name changed"), batch 1 and 8, greedy, in-process engine.

    .venv/bin/python scripts/measure_spec.py [--max-tokens 160] [--batches 1 8] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import torch

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `scripts`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine, collect
from pipeline.params import SamplingParams
from scripts.harness import stopwatch

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
'''
NAMES = ["values", "window", "averages", "total", "index", "value", "moving_average", "window"]


def prompt_for(i: int) -> str:
    old = NAMES[i % len(NAMES)]
    return (f"Rewrite this Python code exactly, but rename `{old}` to `{old}_{i}`. "
            f"Output only the code.\n\n```python\n{CODE}```")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/smollm2-cpu.yaml")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    runner = None
    for draft in ("none", "ngram"):
        core = build_local_engine(load_config(args.config, {
            "draft": draft, "num_speculative_tokens": args.k if draft != "none" else 0}), runner)
        runner = core.stages.verifier.runner
        tok = core.stages.verifier.runner.tokenizer
        for batch in args.batches:
            reqs = []
            for i in range(batch):
                ids = tok.apply_chat_template([{"role": "user", "content": prompt_for(i)}],
                                              add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
                reqs.append((f"{draft}-{batch}-{i}", list(ids),
                             SamplingParams(max_new_tokens=args.max_tokens)))
            c0 = time.process_time()  # prefill alone: the same prompts, one token each
            asyncio.run(collect(core, [(f"p-{rid}", ids, SamplingParams(max_new_tokens=1))
                                       for rid, ids, _ in reqs]))
            prefill_cpu = time.process_time() - c0
            before = (core.stats.steps, core.stats.verify_steps, core.stats.accepted_tokens,
                      list(core.stats.histogram))
            with stopwatch() as took:
                out = asyncio.run(collect(core, reqs))
            dt, cpu = took.wall_s, took.cpu_s
            s = core.stats
            steps = s.steps - before[0]
            verifies, accepted = s.verify_steps - before[1], s.accepted_tokens - before[2]
            tokens = sum(len(c.token_ids) for c in out.values())
            results[(draft, batch)] = [out[r[0]].token_ids for r in reqs]
            hist = [n - (before[3][i] if i < len(before[3]) else 0)
                    for i, n in enumerate(s.histogram)]
            mean_acc = accepted / verifies if verifies else 0.0
            # CPU seconds of this process: steadier than wall time on a shared machine.
            decode_cpu = max(cpu - prefill_cpu, 1e-9)
            print(f"draft={draft:5s} batch={batch}: {tokens} tokens, wall {dt:.2f}s = "
                  f"{tokens / dt:.1f} tok/s; cpu {cpu:.2f}s = {tokens / cpu:.1f} tok/cpu-s "
                  f"(decode only {(tokens - batch) / decode_cpu:.1f} tok/cpu-s, prefill cpu "
                  f"{prefill_cpu:.2f}s); steps={steps}; mean accepted drafts/verify="
                  f"{mean_acc:.2f} (tokens per verify {mean_acc + 1:.2f}); "
                  f"histogram={hist}; finish={[out[r[0]].finish_reason for r in reqs]}", flush=True)
            if batch == args.batches[0]:
                print("    sample:", repr(out[reqs[0][0]].text[:120]))
    for batch in args.batches:
        same = results[("none", batch)] == results[("ngram", batch)]
        print(f"batch={batch}: n-gram output identical to target-only: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
