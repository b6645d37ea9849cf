"""`specrelay generate`: start local Ray and an engine, complete the prompts, print the results
with finish reason, matched stop, speculative statistics and throughput."""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from typing import Any

import ray

from actors.engine import start_engine, stop_engine
from actors.engine_client import EngineClient
from pipeline.config import load_config
from pipeline.frontend.metrics import tokens_per_verify
from pipeline.models.runners import load_engine_tokenizer
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specrelay generate", description=__doc__)
    p.add_argument("--config", default="configs/smollm2-cpu.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (YAML value), e.g. --set draft=none")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    return p.parse_args(argv)


def overrides(pairs: list[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def encode(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return list(tokenizer.encode(prompt))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


async def complete(handle: Any, prompts: list[list[int]], params: SamplingParams) -> list[list]:
    client = EngineClient(handle)

    async def one(i: int, ids: list[int]) -> list:
        return [d async for d in client.generate(EngineCall(f"cli-{i}", ids, params))]

    return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(argv or []))
    config = load_config(args.config, overrides(args.set))
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, stop=args.stop, seed=args.seed,
                            logprobs=args.logprobs, ignore_eos=args.ignore_eos)
    tokenizer = load_engine_tokenizer(config)
    prompts = [encode(tokenizer, p, args.chat) for p in args.prompts]
    owns_ray = not ray.is_initialized()  # inside a running Ray (tests, a job): use it
    if owns_ray:
        ray.init(include_dashboard=False, log_to_driver=False,
                 num_cpus=max(2, config.tensor_parallel_size + 1))
    # SIGTERM ends the run like Ctrl-C: through the finally blocks, so every actor's spans
    # are exported (stop_engine flushes them) before Ray goes away.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        handle = start_engine(config)
        try:
            t0 = time.perf_counter()
            results = asyncio.run(complete(handle, prompts, params))
            elapsed = time.perf_counter() - t0
            stats = ray.get(handle.stats.remote())
        finally:
            stop_engine(handle)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if owns_ray:
            ray.shutdown()
    total = 0
    for text, deltas in zip(args.prompts, results):
        last = deltas[-1]
        ids = [t for d in deltas for t in d.token_ids]
        total += len(ids)
        print(f"=== {text!r}")
        print("".join(d.text for d in deltas))
        print(f"--- finish_reason={last.finish_reason} matched_stop={last.matched_stop!r} "
              f"tokens={len(ids)} verify_steps={last.spec_verify_ct} "
              f"accepted_tokens={last.spec_accepted_tokens} "
              f"draft_tokens={last.spec_draft_tokens} "
              f"histogram={last.spec_acceptance_histogram}")
        if args.logprobs is not None:
            lps = [lp for d in deltas for lp in (d.logprobs or [])]
            print(f"--- logprobs={[round(x, 3) for x in lps]}")
    print(f"=== {total} tokens in {elapsed:.2f}s: {total / elapsed:.1f} tokens/s; engine: "
          f"steps={stats['steps']} drafted={stats['num_draft_tokens']} "
          f"accepted={stats['num_accepted_tokens']} "
          f"tokens_per_verify={tokens_per_verify(stats):.2f} "
          f"histogram={stats['acceptance_histogram']}")
    return 0
