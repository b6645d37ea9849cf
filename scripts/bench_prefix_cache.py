"""Prefix caching, the issue's must-show 1: an agent-style conversation through the OpenAI API
(a ~1,050-token system prompt of tool docs, 6 chat turns each re-sending the whole history,
greedy), with the cache on and off. Prints per turn the prompt tokens, `cached_tokens` and the
time to first token (first streamed content chunk), then the sum of TTFT over turns 2-6 (on / off)
and whether the answers are identical.

The HTTP app (pipeline.frontend.app) runs under uvicorn on a loopback port over the in-process
engine (no Ray); the client streams with httpx.

    PYTHONPATH=. .venv/bin/python scripts/bench_prefix_cache.py [--config configs/smollm2-cpu.yaml]
        [--turns 6] [--max-tokens 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `scripts`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import torch
import uvicorn

from pipeline.config import load_config
from pipeline.engine.local import LocalEngineClient, build_local_engine
from pipeline.frontend.app import ServerSettings, create_app
from scripts.harness import free_port, wait_healthy

TOOLS = ("read_file", "write_file", "search", "list_dir", "run_tests", "git_diff", "git_log",
         "open_issue", "comment", "http_get", "python", "shell")
USER_TURNS = (
    "List the files under pipeline/models and say which one holds the KV cache.",
    "Read pipeline/models/block_manager.py lines 1-40 and summarise the invariants.",
    "Search for 'CacheFullError' and tell me where it is raised.",
    "Run the tests in tests/test_block_manager.py and report the result.",
    "Show the git log of the last three commits touching the scheduler.",
    "Write a one-paragraph summary of what you found for the pull request.",
)


def system_prompt(tools: int = 12) -> str:
    """Tool documentation of the kind an agent framework sends every turn."""
    docs = []
    for i, name in enumerate(TOOLS[:tools]):
        docs.append(
            f"### {name}\n{name}(path: str, start_line: int = 1, end_line: int | None = None, "
            f"pattern: str | None = None) -> str\nTool number {i + 1}. Call it with a JSON object "
            f'{{"tool": "{name}", "arguments": {{...}}}}. It returns plain text; errors come back '
            f"as a line starting with 'error:'. Never call {name} on paths outside the "
            f"repository, and quote the exact arguments you used when you report its result.\n")
    return ("You are a careful coding agent working in a Python repository. Answer briefly. "
            "You have these tools:\n\n" + "\n".join(docs))


def serve(overrides: dict[str, Any], config_path: str) -> tuple[uvicorn.Server, str, Any]:
    core = build_local_engine(load_config(config_path, overrides))
    app = create_app(LocalEngineClient(core), core.stages.verifier.runner.tokenizer,
                     ServerSettings())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, timeout=60, interval=0.1)
    return server, base, core


def conversation(base: str, turns: int, max_tokens: int,
                 system: str | None = None) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": system_prompt() if system is None else system}]
    out = []
    with httpx.Client(base_url=base, timeout=600) as client:
        for user in USER_TURNS[:turns]:
            messages.append({"role": "user", "content": user})
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            start = time.perf_counter()
            ttft, text, usage = None, "", None
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        piece = choice["delta"].get("content") or ""
                        if piece and ttft is None:
                            ttft = time.perf_counter() - start
                        text += piece
            out.append({"ttft": ttft, "text": text, "prompt": usage["prompt_tokens"],
                        "cached": usage["prompt_tokens_details"]["cached_tokens"]})
            messages.append({"role": "assistant", "content": text})
    return out


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/smollm2-cpu.yaml")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tools", type=int, default=12, help="tool docs in the system prompt")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    extra = {} if args.max_model_len is None else {"max_model_len": args.max_model_len}
    results = {}
    for label, caching in (("on", True), ("off", False)):
        server, base, _core = serve({"enable_prefix_caching": caching, **extra}, args.config)
        # warm-up (first-call costs) on another system prompt: turn 1 starts cold
        conversation(base, 1, 4, system="Warm up.")  # shares < 1 block
        results[label] = conversation(base, args.turns, args.max_tokens, system_prompt(args.tools))
        server.should_exit = True
    print(f"{'turn':>4} {'prompt':>6} {'cached on':>9} {'TTFT on s':>9} {'TTFT off s':>10}")
    for i, (on, off) in enumerate(zip(results["on"], results["off"])):
        print(f"{i + 1:>4} {on['prompt']:>6} {on['cached']:>9} {on['ttft']:>9.3f} "
              f"{off['ttft']:>10.3f}")
    on_sum = sum(t["ttft"] for t in results["on"][1:])
    off_sum = sum(t["ttft"] for t in results["off"][1:])
    print(f"sum TTFT turns 2-{args.turns}: on {on_sum:.3f} s, off {off_sum:.3f} s, "
          f"ratio {on_sum / off_sum:.3f} (target <= 0.35)")
    frac = min(cur["cached"] / prev["prompt"]
               for prev, cur in zip(results["on"], results["on"][1:]))
    print(f"min cached_tokens / previous turn's prompt: {frac:.3f} (target >= 0.8)")
    same = [a["text"] for a in results["on"]] == [b["text"] for b in results["off"]]
    print(f"answers identical with caching on and off: {same}")
    return results


if __name__ == "__main__":
    main()
