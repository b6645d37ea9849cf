"""Engine replicas, issue 44's must-show 3: does throughput scale with replicas, and what does the
ingress -> replica hop add to the time to first token?

Throughput: two Serve applications run side by side on one local Ray cluster, the same app
(`actors.serve_app:build_app`, the config's `torch_threads` per actor, one by default) with one
engine replica and with `--replicas` of them. A closed loop of `--concurrency` clients (enough to
keep one replica's batch full and its queue non-empty) sends greedy completions of fresh
random-token prompts through HTTP; the two apps take turns (interleaved repeats, the order
alternating). Per run: completion tokens per second, the CPU seconds of every process of the
cluster (the driver's own load generator counted apart) and cores used; the summary is the median
and spread (min..max) over the repeats and the median of the paired speedups. Every output on the
replicated app must equal the single-engine app's output for the same prompt (exit status 1 if
not).

Hop: at concurrency 1, on the one-replica app, the same request alternately (a) straight to the
replica's Engine actor (EngineClient, what an engine does without Serve) and (b) through the
engine deployment's Serve handle (the router, the replica actor, its streaming generator: the
ingress's own path to the replica), both from this process; TTFT = the first streamed output.
The hop is reported two ways: paired, the p50/p99 of (b) - (a) over the pairs (two different
requests a pair, so the engine's own TTFT variance is in it twice and dominates its p99); and as
the shift of the distribution, p50(b) - p50(a) and p99(b) - p99(a) (what a user compares: TTFT
percentiles with and without the hop). A plain call through the hop (the replica's `health`, vs
the Engine actor's) measures it without the engine's variance. HTTP TTFT (proxy + ingress + hop +
engine) is printed for context.

    PYTHONPATH=. .venv/bin/python scripts/bench_replicas.py [--config configs/tiny.yaml]
        [--replicas 2] [--concurrency 16] [--requests 64] [--max-tokens 48] [--reps 3]
        [--hop-requests 60] [--out bench-out/replicas.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from scripts.harness import cpu_delta, interleaved, parse_sets, run_meta, tree_cpu, write_json
from scripts.replicas_bench.apps import MANY, ONE, start_apps, stop_apps
from scripts.replicas_bench.hop import measure_hop


@dataclass
class Run:
    app: str
    replicas: int
    rep: int
    wall_s: float
    tokens: int
    cpu_s: float  # every process of the local cluster, the driver excluded
    driver_cpu_s: float
    failed: int
    texts: dict[int, str] = field(default_factory=dict, repr=False)
    cores_by_role: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def cores(self) -> float:
        return self.cpu_s / self.wall_s


# --- measuring -----------------------------------------------------------------------------------


def role(pid: int, argv: list[str]) -> str:
    """A local cluster's process by role: a local Ray's GCS, raylet, Serve proxy and actor workers
    descend from the driver; the role is the process title Ray gives an actor worker
    (`ray::Engine`, `ray::ServeReplica:<app>:<deployment>`) with the method it runs cut off."""
    name = "driver" if pid == os.getpid() else argv[0].split(" ")[0]
    if name.startswith("ray::"):
        return name.split(".")[0]
    if "/" in name:
        return os.path.basename(name) + " " + " ".join(os.path.basename(a) for a in argv[1:2])
    return name


def prompts_for(rep: int, count: int, length: int, vocab: int = 256) -> list[list[int]]:
    """Fresh random prompts per repeat (no prefix-cache hits between repeats); the same ones for
    both apps within a repeat."""
    rng = random.Random(1000 + rep)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


async def closed_loop(url: str, model: str, prompts: list[list[int]], concurrency: int,
                      max_tokens: int) -> tuple[int, int, dict[int, str]]:
    """Every prompt once, `concurrency` in flight; (completion tokens, failed, texts)."""
    queue = list(enumerate(prompts))
    texts: dict[int, str] = {}
    tokens = failed = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens, failed
        while queue:
            i, ids = queue.pop(0)
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                failed += 1
                continue
            out = r.json()
            tokens += out["usage"]["completion_tokens"]
            texts[i] = out["choices"][0]["text"]

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return tokens, failed, texts


def wave(base: str, app: str, replicas: int, rep: int, model: str, prompts: list[list[int]],
         args: argparse.Namespace) -> Run:
    c0 = tree_cpu()
    t0 = time.perf_counter()
    tokens, failed, texts = asyncio.run(closed_loop(f"{base}/{app}", model, prompts,
                                                    args.concurrency, args.max_tokens))
    wall = time.perf_counter() - t0
    by_role = cpu_delta(c0, tree_cpu(), role)
    driver = by_role.pop("driver", 0.0)
    return Run(app, replicas, rep, wall, tokens, sum(by_role.values()), driver, failed, texts,
               {k: round(v / wall, 3) for k, v in sorted(by_role.items()) if v / wall >= 0.01})


# --- the report ----------------------------------------------------------------------------------


def summarize(runs: list[Run], replicas: int) -> dict[str, Any]:
    def of(app: str) -> list[Run]:
        return [r for r in runs if r.app == app]

    out: dict[str, Any] = {}
    for app, n in ((ONE, 1), (MANY, replicas)):
        tps = [r.tokens_per_s for r in of(app)]
        cores = [r.cores for r in of(app)]
        out[f"{n}_replica"] = {
            "tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps),
            "tokens_per_s_max": max(tps), "cores_median": statistics.median(cores),
            "tokens_per_cpu_s_median": statistics.median(r.tokens / r.cpu_s for r in of(app)),
            "driver_cores_median": statistics.median(r.driver_cpu_s / r.wall_s
                                                     for r in of(app)),
            "failed": sum(r.failed for r in of(app))}
    speedups = [b.tokens_per_s / a.tokens_per_s for a, b in zip(of(ONE), of(MANY))]
    out["speedup_median"] = statistics.median(speedups)
    out["speedup_min"], out["speedup_max"] = min(speedups), max(speedups)
    return out


def mismatches(runs: list[Run]) -> list[str]:
    """Prompts whose replicated output differs from the single engine's (same repeat)."""
    bad = []
    for a, b in zip([r for r in runs if r.app == ONE], [r for r in runs if r.app == MANY]):
        for i, text in a.texts.items():
            if b.texts.get(i) != text:
                bad.append(f"repeat {a.rep} prompt {i}: {text!r} != {b.texts.get(i)!r}")
        bad += [f"repeat {a.rep} prompt {i}: missing on 1 replica"
                for i in set(b.texts) - set(a.texts)]
    return bad


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16,
                   help="clients in flight (default: twice the tiny config's 8 slots)")
    p.add_argument("--requests", type=int, default=64, help="requests per run")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=3, help="interleaved repeats")
    p.add_argument("--hop-requests", type=int, default=60, help="0: skip the hop measurement")
    p.add_argument("--threads", type=int, default=1, help="torch threads per actor")
    p.add_argument("--cpus", type=int, default=None,
                   help="logical CPUs of the local Ray (default: replicas + 2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="extra engine config override (repeatable)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--verbose", action="store_true", help="print cores used by process role")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    overrides: dict[str, Any] = {"torch_threads": args.threads, **parse_sets(args.set, json.loads)}
    start = time.perf_counter()
    import ray

    own_ray = not ray.is_initialized()
    try:  # a failed start stops Serve too: a later app on this Ray must not find it running
        base = start_apps(args.config, args.replicas, overrides, args.cpus or args.replicas + 2)
        model = httpx.get(f"{base}/{ONE}/v1/models", timeout=30).json()["data"][0]["id"]
        warm = prompts_for(-1, 4 * args.replicas, args.prompt_len)
        for app, n in ((ONE, 1), (MANY, args.replicas)):  # first forwards on every replica
            asyncio.run(closed_loop(f"{base}/{app}", model, warm, 2 * n, 4))

        def measure(arm: tuple[str, int], rep: int) -> Run:
            (app, n), prompts = arm, prompts_for(rep, args.requests, args.prompt_len)
            r = wave(base, app, n, rep, model, prompts, args)
            print(f"repeat {rep} {n} replica(s): {r.tokens_per_s:7.1f} tokens/s, "
                  f"{r.wall_s:6.2f} s, {r.cores:4.2f} cores (+ driver "
                  f"{r.driver_cpu_s / r.wall_s:4.2f}), failed {r.failed}", flush=True)
            if args.verbose:
                print("   cores by process:", r.cores_by_role, flush=True)
            return r

        by_app = interleaved([(ONE, 1), (MANY, args.replicas)], args.reps, measure)
        runs = sorted((r for rs in by_app.values() for r in rs),
                      key=lambda r: (r.rep, r.app != ONE))
        summary = summarize(runs, args.replicas)
        bad = mismatches(runs)
        hop: dict[str, Any] = {}
        if args.hop_requests:
            hop = measure_hop(ONE, f"{base}/{ONE}", model,
                              prompts_for(99, args.hop_requests, args.prompt_len),
                              prompts_for(98, args.hop_requests, args.prompt_len),
                              4 * args.hop_requests)
    finally:
        stop_apps(own_ray)
    elapsed = time.perf_counter() - start

    one, many = summary["1_replica"], summary[f"{args.replicas}_replica"]
    print(f"\n{'replicas':>8} {'tokens/s median':>15} {'min..max':>15} {'cores':>6} "
          f"{'tokens/CPU-s':>12} {'failed':>6}")
    for n, s in ((1, one), (args.replicas, many)):
        print(f"{n:>8} {s['tokens_per_s_median']:>15.1f} "
              f"{s['tokens_per_s_min']:>7.1f}..{s['tokens_per_s_max']:<7.1f} "
              f"{s['cores_median']:>6.2f} {s['tokens_per_cpu_s_median']:>12.1f} "
              f"{s['failed']:>6}")
    print(f"speedup {args.replicas} vs 1 replica: median {summary['speedup_median']:.2f}x "
          f"(paired, {summary['speedup_min']:.2f}..{summary['speedup_max']:.2f}; target >= 1.6)")
    print(f"outputs equal to the single engine's: {not bad} ({len(bad)} differ)")
    if hop:
        print(f"TTFT at concurrency 1 ({args.hop_requests} requests, ms): "
              + ", ".join(f"{k} p50 {v['p50_ms']:.2f} p99 {v['p99_ms']:.2f}"
                          for k, v in hop.items() if isinstance(v, dict)))
        print(f"ingress -> replica hop adds p50 {hop['hop_added']['p50_ms']:.2f} ms, "
              f"p99 {hop['hop_added']['p99_ms']:.2f} ms to TTFT, paired (target <= 10); "
              f"shifts TTFT p50 by {hop['ttft_shift']['p50_ms']:.2f} ms, p99 by "
              f"{hop['ttft_shift']['p99_ms']:.2f} ms; a call through it (health) p50 "
              f"{hop['hop_call_added']['p50_ms']:.2f} ms, p99 {hop['hop_call_added']['p99_ms']:.2f} ms")
    result = {"meta": run_meta(args, elapsed), "summary": summary, "hop": hop,
              "mismatches": bad[:20],
              "runs": [{k: v for k, v in asdict(r).items() if k != "texts"} for r in runs]}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(1 if res["mismatches"] or any(
        res["summary"][k]["failed"] for k in res["summary"] if k.endswith("_replica")) else 0)
