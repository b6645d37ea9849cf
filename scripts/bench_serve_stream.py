"""Streaming through HTTP, as a user of `specrelay serve` sees it: ms per token of one stream and
total tok/s of N concurrent streams, on a config with no drafts by default (the step's transport
and relay, not speculation).

    .venv/bin/python scripts/bench_serve_stream.py [--config configs/tiny.yaml] [--set draft=none]
        [--tokens 200] [--concurrency 8] [--reps 3] [--num-cpus 2] [--out bench-out/serve]

It starts `specrelay serve` (a local Ray of `--num-cpus` CPUs) in a session of its own, streams
`/v1/completions` with token-id prompts and `ignore_eos` (every request runs to `--tokens`), and
per repetition runs one stream alone (ms per token after the first: the inter-token time) and
`--concurrency` streams together (all tokens over the wall time), the two alternating. CPU is the
server's whole process tree (Ray's processes and actors), per output token. Outputs are checked:
with the null model (`--set model=null:0`) against its known sequence; with any model, each
prompt's output must be the same in every repetition and at every concurrency (greedy). Writes
`<out>/results.json` with the commit and whether the tree was dirty.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import yaml

from pipeline.config import parse_null_source
from pipeline.models.null import null_config
from pipeline.models.runners import tiny_tokenizer
from scripts.harness import (
    ROOT,
    alternated,
    cpu_delta,
    free_port,
    null_tokens,
    parse_sets,
    spread,
    stop_group,
    tree_cpu,
    tree_state,
    wait_healthy,
    write_json,
)


def process_name(pid: int, argv: list[str]) -> str:
    """A server process by its title (Ray names its workers after the actor: `ray::Engine`,
    `ray::ServeReplica:...`)."""
    return argv[0].split(" ")[0][:60]


async def stream(client: httpx.AsyncClient, base: str, prompt: list[int], tokens: int
                 ) -> tuple[list[float], str]:
    """Arrival times of each streamed chunk's tokens (one time per token) and the text."""
    model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    times: list[float] = []
    text = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        buffer = ""
        # split on "\n" only: aiter_lines also splits on U+0085 and U+2028, which a token's
        # text may hold inside an event's JSON
        async for chunk in r.aiter_text():
            buffer += chunk
            *lines, buffer = buffer.split("\n")
            now = time.perf_counter()
            for line in lines:
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                n = len((choice.get("logprobs") or {}).get("tokens") or [])
                times.extend([now] * n)
                text.append(choice.get("text", ""))
    return times, "".join(text)


def prompts(n: int, vocab: int) -> list[list[int]]:
    return [[(5 + 11 * i + j) % vocab for j in range(8)] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--out", default=os.path.join("bench-out", "serve"))
    args = p.parse_args(argv)
    with open(args.config) as f:
        config = yaml.safe_load(f)
    config.update({"draft": "none", "max_model_len": args.tokens + 64})
    config.update(parse_sets(args.set))
    config["num_slots"] = max(int(config.get("num_slots", 8)), args.concurrency)
    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    cfg_path = os.path.join(tmp, "config.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(config, f)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = open(os.path.join(tmp, "serve.log"), "w")  # noqa: SIM115 - the server outlives a block
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "serve", "--config", cfg_path,
                             "--port", str(port), "--num-cpus", str(args.num_cpus)], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    null_ms = parse_null_source(str(config.get("model", "")))
    vocab = null_config().vocab_size
    single, multi, cpu_per_tok = [], [], []
    per_process: dict[tuple[str, str], list[float]] = {}
    outputs: dict[int, set[str]] = {}
    bad = 0
    try:
        wait_healthy(base, proc=proc)
        ps = prompts(args.concurrency, vocab)

        async def run() -> None:
            nonlocal bad
            async with httpx.AsyncClient(timeout=600) as client:
                await stream(client, base, ps[0], 8)  # warm
                for rep in range(args.reps):
                    for part in alternated(("one", "many"), rep):
                        batch = ps[:1] if part == "one" else ps
                        c0, t0 = tree_cpu(proc.pid), time.perf_counter()
                        got = await asyncio.gather(*(stream(client, base, q, args.tokens)
                                                     for q in batch))
                        wall = time.perf_counter() - t0
                        by_name = cpu_delta(c0, tree_cpu(proc.pid), process_name)
                        cpu = sum(by_name.values())
                        n = sum(len(t) for t, _ in got)
                        for name, c in by_name.items():
                            per_process.setdefault((part, name), []).append(c * 1e3 / n)
                        bad += sum(len(t) != args.tokens for t, _ in got)
                        for i, (_, text) in enumerate(got):
                            outputs.setdefault(i, set()).add(text)
                        if part == "one":
                            times = got[0][0]
                            single.append((times[-1] - times[0]) * 1e3 / (len(times) - 1))
                        else:
                            multi.append(n / wall)
                        cpu_per_tok.append((part, cpu * 1e3 / n))

        asyncio.run(run())
    finally:
        stop_group(proc)
        log.close()
    bad += sum(len(texts) != 1 for texts in outputs.values())
    if null_ms is not None:  # the null model's text is its known sequence, byte by byte
        bad += int(outputs.get(0) != {expected_text(prompts(1, vocab)[0], args.tokens)})
    result = {
        "ms_per_token_one_stream": statistics.median(single),
        "one_stream_spread": spread(single) or 0.0,
        f"tok_s_{args.concurrency}_streams": statistics.median(multi),
        "many_streams_spread": spread(multi) or 0.0,
        "server_cpu_ms_per_token": {
            part: statistics.median(c for q, c in cpu_per_tok if q == part)
            for part in ("one", "many")},
        "server_cpu_ms_per_token_by_process": {
            f"{part}: {name}": statistics.median(v) for (part, name), v in
            sorted(per_process.items()) if statistics.median(v) >= 0.05},
        "bad_outputs": bad, "config": config, "args": vars(args), "tree": tree_state()}
    print(json.dumps({k: v for k, v in result.items() if k not in ("config", "args")}, indent=1))
    write_json(os.path.join(args.out, "results.json"), result, indent=2)
    return 1 if bad else 0


def expected_text(prompt: list[int], tokens: int) -> str:
    """The null model's output (its known successor chain) as the byte tokenizer writes it."""
    return tiny_tokenizer().decode(null_tokens(prompt[-1], tokens), skip_special_tokens=True)


if __name__ == "__main__":
    sys.exit(main())
