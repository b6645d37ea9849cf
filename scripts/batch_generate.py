"""Batch generation as a Ray Job: every prompt of a JSON-lines file through one engine.

    ray job submit --address http://127.0.0.1:8265 -- .venv/bin/python scripts/batch_generate.py \\
        --input prompts.jsonl --output results.jsonl [--config FILE] [--max-tokens N]

Input: one JSON object per line with `prompt` (text or token ids) or chat `messages`, optionally
`id` and OpenAI sampling fields (max_tokens, temperature, top_p, top_k, seed, stop,
stop_token_ids, ignore_eos, min_tokens, include_stop_str_in_output, logprobs); a bare JSON
string is a prompt. Output: one object per input line, in input order: id, text, finish_reason,
matched_stop, token counts (cached_tokens: prompt tokens served from the prefix cache), spec_stats (or `error` for a line that could not run).

Joins the running Ray cluster (RAY_ADDRESS as set by `ray job submit`, or --address, or
"auto"); starts a local one when there is none; says which it joined (address, resources).
When the engine cannot be placed within --start-timeout seconds it says what it needs and what
the cluster has free, and exits 3. On SIGTERM (or Ctrl-C) it stops at once, writes the finished
lines (the others as `error: "interrupted"`), exports its spans and exits 143 (130).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

# `ray job submit` runs this file by path; make the repository's packages importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray

from actors.engine import engine_needs, start_engine, stop_engine
from actors.engine_client import EngineClient
from pipeline.config import load_config
from pipeline.errors import EngineOverloadedError
from pipeline.frontend import requests as reqs
from pipeline.frontend.errors import APIError, bad_request
from pipeline.frontend.responses import ChoiceState
from pipeline.frontend.structured import request_grammar, wants_grammar
from pipeline.frontend.tokenizer import TokenizerAdapter
from pipeline.models.runners import load_engine_tokenizer
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall

DEFAULT_CONFIG = "configs/smollm2-cpu.yaml"
INTERRUPTED = "interrupted"  # the error of a line the job stopped before finishing


@dataclass
class Item:
    index: int
    id: Any
    prompt_ids: list[int] | None = None
    params: SamplingParams | None = None
    error: str | None = None


@dataclass
class Progress:
    total: int
    done: int = 0
    errors: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.monotonic)
    interrupted: bool = False

    def line(self) -> str:
        dt = max(time.monotonic() - self.start, 1e-9)
        return (f"progress: {self.done}/{self.total} prompts, {self.errors} errors, "
                f"{self.tokens} tokens, {self.tokens / dt:.1f} tok/s, {dt:.1f}s")


def parse_line(index: int, line: str, tokenizer: TokenizerAdapter, max_model_len: int,
               vocab_size: int, default_max_tokens: int | None) -> Item:
    """One input line -> prompt ids and SamplingParams (validated like the HTTP API)."""
    try:
        data = json.loads(line)
    except ValueError as e:
        return Item(index, None, error=f"invalid JSON: {e}")
    if isinstance(data, str):
        data = {"prompt": data}
    if not isinstance(data, dict):
        return Item(index, None, error="each line must be a JSON object or string")
    item_id = data.pop("id", index)
    if default_max_tokens is not None:
        data.setdefault("max_tokens", default_max_tokens)
    data["stream"] = False
    data.pop("n", None)
    try:
        if "messages" in data:
            req = reqs.parse_chat_request(data)
            ids = tokenizer.chat_prompt(reqs.chat_messages_as_dicts(req),
                                        req.add_generation_prompt)
        else:
            req = reqs.parse_completion_request(data)
            prompts = reqs.completion_prompts(req)
            if len(prompts) != 1:
                raise bad_request("prompt: one prompt per line", param="prompt")
            one = prompts[0]
            ids = list(tokenizer.encode(one)) if isinstance(one, str) else list(one)
            reqs.check_prompt_ids(ids, vocab_size, "prompt")
        grammar = request_grammar(req, tokenizer.tok) if wants_grammar(req) else None
        params = reqs.to_sampling_params(req, len(ids), max_model_len, grammar=grammar)
    except APIError as e:
        return Item(index, item_id, error=e.message)
    return Item(index, item_id, ids, params)


async def run_one(engine: Any, item: Item, rid: str, last: bool = False) -> dict[str, Any]:
    """Generate one item, retrying while the engine's queue is full. `last`: the job's final
    prompt, so the engine knows its batch drains once it is admitted."""
    assert item.prompt_ids is not None and item.params is not None
    choice = ChoiceState(index=0)
    delay = 0.05
    while True:
        try:
            async for out in engine.generate(EngineCall(rid, item.prompt_ids, item.params,
                                                        last=last)):
                choice.add(out)
            break
        except EngineOverloadedError:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
    return {"id": item.id, "index": item.index, "text": choice.text,
            "finish_reason": choice.finish_reason, "matched_stop": choice.matched_stop,
            "prompt_tokens": len(item.prompt_ids), "completion_tokens": len(choice.token_ids),
            "cached_tokens": choice.cached_tokens or 0,  # prompt tokens from the prefix cache
            "spec_stats": choice.spec_stats(), "error": None}


async def generate_all(engine: Any, items: list[Item], concurrency: int,
                       progress_every: float) -> tuple[Progress, list[dict[str, Any]]]:
    """Every item through the engine, at most `concurrency` at once; results in input order."""
    progress = Progress(total=len(items))
    results: dict[int, dict[str, Any]] = {}
    sem = asyncio.Semaphore(concurrency)
    run_id = f"batch-{os.getpid()}-{int(time.time())}"
    last = max((it.index for it in items if it.error is None), default=-1)

    async def one(item: Item) -> None:
        if item.error is not None:
            res = {"id": item.id, "index": item.index, "error": item.error}
        else:
            async with sem:
                try:
                    res = await run_one(engine, item, f"{run_id}-{item.index}",
                                        item.index == last)
                except Exception as e:  # noqa: BLE001 - one failed prompt must not stop the job
                    res = {"id": item.id, "index": item.index,
                           "error": f"{type(e).__name__}: {e}"}
        results[item.index] = res
        progress.done += 1
        progress.errors += res.get("error") is not None
        progress.tokens += res.get("completion_tokens", 0)

    async def report() -> None:
        while True:
            await asyncio.sleep(progress_every)
            print(progress.line(), flush=True)

    reporter = asyncio.create_task(report())
    work = asyncio.gather(*(one(it) for it in items))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop now; the finished lines are kept
        loop.add_signal_handler(sig, work.cancel)
    try:
        await work
    except asyncio.CancelledError:
        print(f"interrupted: {progress.done}/{progress.total} prompts finished", flush=True)
        progress.interrupted = True
    finally:
        reporter.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return progress, [results.get(i) or {"id": items[i].id, "index": i, "error": INTERRUPTED}
                      for i in range(len(items))]


def write_results(path: str, rows: list[dict[str, Any]]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(tmp, path)  # readers never see a half-written results file


def connect_ray(address: str | None) -> None:
    """Join `address`, RAY_ADDRESS or a running local cluster, else start one; say which."""
    if address or os.environ.get("RAY_ADDRESS"):
        address = address or os.environ["RAY_ADDRESS"]
        ray.init(address=address)
        how = "started a local Ray cluster" if address == "local" else "joined the Ray cluster"
    else:
        try:
            ray.init(address="auto")
            how = "joined the running local Ray cluster"
        except ConnectionError:
            ray.init()
            how = "no running Ray cluster found: started a local one"
    print(f"{how} at {ray.get_runtime_context().gcs_address}: "
          f"{len(ray.nodes())} node(s), resources {ray.cluster_resources()}, "
          f"available {ray.available_resources()}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--input", required=True, help="prompts, JSON lines")
    p.add_argument("--output", required=True, help="results, JSON lines (input order)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="engine config YAML")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default max_tokens for lines that do not set it")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (default: the engine's slots + waiting room)")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS/auto)")
    p.add_argument("--progress-every", type=float, default=5.0, help="seconds between lines")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds the engine may take to be placed and loaded (then exit 3)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config_path = args.config
    if not os.path.exists(config_path) and os.path.exists(os.path.join(root, config_path)):
        config_path = os.path.join(root, config_path)
    config = load_config(config_path)
    tokenizer = TokenizerAdapter(load_engine_tokenizer(config))
    with open(args.input, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    connect_ray(args.address)
    t0 = time.monotonic()
    print(f"starting the engine: it needs {engine_needs(config)}", flush=True)
    # Ctrl-C or SIGTERM while the engine starts: exit through the finally blocks.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        handle = start_engine(config, timeout_s=args.start_timeout)
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    print(f"engine {config.served_name} ready in {time.monotonic() - t0:.1f}s; "
          f"{len(lines)} prompts", flush=True)
    try:
        info = asyncio.run(_model_info(handle))
        items = [parse_line(i, line, tokenizer, config.max_model_len, int(info["vocab_size"]),
                            args.max_tokens) for i, line in enumerate(lines)]
        concurrency = args.concurrency or config.num_slots + config.max_waiting
        progress, rows = asyncio.run(generate_all(EngineClient(handle), items, concurrency,
                                                  args.progress_every))
        signal.signal(signal.SIGTERM, _exit_on_signal)  # asyncio reset it; stop_engine flushes
    finally:
        stop_engine(handle)  # also exports the engine's and the output actor's spans
    write_results(args.output, rows)
    print(progress.line(), flush=True)
    print(f"wrote {args.output}", flush=True)
    if progress.interrupted:
        return 143
    return 0  # per-line errors are in the results file and the counts above


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


async def _model_info(handle: Any) -> dict[str, Any]:
    return await handle.model_info.remote()


if __name__ == "__main__":
    sys.exit(main())
