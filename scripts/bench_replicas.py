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
import platform
import random
import socket
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from scripts.tree_state import tree_state

ONE, MANY = "bench-r1", "bench-rn"  # the two applications (and their route prefixes)


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


# --- the cluster and the apps --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_apps(config: str, replicas: int, overrides: dict[str, Any], cpus: int) -> str:
    """A local Ray with `cpus` logical CPUs, Serve on a free loopback port, and the two apps;
    returns the base URL."""
    import ray
    from ray import serve

    from actors.serve_app import build_app

    if not ray.is_initialized():  # a test's cluster is reused (its CPUs are its own)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    wait_for_resources(config, overrides, 1 + replicas)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for name, n in ((ONE, 1), (MANY, replicas)):
        serve.run(build_app({"config": config, "overrides": overrides, "num_replicas": n,
                             "request_timeout_s": 600}),
                  name=name, route_prefix=f"/{name}", blocking=False)
    base = f"http://127.0.0.1:{port}"
    for name in (ONE, MANY):
        wait_healthy(f"{base}/{name}")
    return base


def wait_for_resources(config: str, overrides: dict[str, Any], engines: int,
                       timeout: float = 60.0) -> None:
    """Wait until the cluster has the verifier placement groups of `engines` engines free; a
    clear error otherwise, where serve.run would wait for them forever."""
    import ray

    from pipeline.config import load_config

    cfg = load_config(config, overrides)
    need: dict[str, float] = {}
    for bundle in cfg.placement_spec.verifier_bundles(
            cfg.tensor_parallel_size, cfg.device.startswith("cuda")) * engines:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount
    deadline = time.monotonic() + timeout
    while any((free := ray.available_resources()).get(k, 0.0) < v for k, v in need.items()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{engines} engines need {need} for their verifier ranks; the "
                               f"cluster has {free} free of {ray.cluster_resources()}")
        time.sleep(0.5)


def wait_healthy(url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(f"{url}/health", timeout=5)
            if last.status_code == 200:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy: {last}")


def stop_apps(own_ray: bool) -> None:
    import ray
    from ray import serve

    serve.shutdown()
    if own_ray:
        ray.shutdown()


# --- measuring -----------------------------------------------------------------------------------


def process_cpu_s() -> dict[tuple[int, str], float]:
    """CPU seconds of every process of the local cluster by (pid, role): a local Ray's GCS,
    raylet, Serve proxy and actor workers descend from the driver; the role is the process
    title Ray gives an actor worker (`ray::Engine`, `ray::ServeReplica:<app>:<deployment>`) with
    the method it runs cut off."""
    import psutil

    out = {}
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            title = (proc.cmdline() or [proc.name()])[0]
        except psutil.Error:  # gone meanwhile
            continue
        role = "driver" if proc.pid == me.pid else title.split(" ")[0]
        if role.startswith("ray::"):
            role = role.split(".")[0]
        elif "/" in role:
            role = os.path.basename(role) + " " + " ".join(
                os.path.basename(a) for a in proc.cmdline()[1:2])
        out[(proc.pid, role)] = t.user + t.system
    return out


def cpu_delta(before: dict[tuple[int, str], float], after: dict[tuple[int, str], float],
              ) -> dict[str, float]:
    """CPU seconds spent between two snapshots, summed by role."""
    by_role: dict[str, float] = {}
    for key, t in after.items():
        by_role[key[1]] = by_role.get(key[1], 0.0) + t - before.get(key, 0.0)
    return by_role


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
    c0 = process_cpu_s()
    t0 = time.perf_counter()
    tokens, failed, texts = asyncio.run(closed_loop(f"{base}/{app}", model, prompts,
                                                    args.concurrency, args.max_tokens))
    wall = time.perf_counter() - t0
    by_role = cpu_delta(c0, process_cpu_s())
    driver = by_role.pop("driver", 0.0)
    return Run(app, replicas, rep, wall, tokens, sum(by_role.values()), driver, failed, texts,
               {k: round(v / wall, 3) for k, v in sorted(by_role.items()) if v / wall >= 0.01})


async def hop_ttft(app: str, prompts: list[list[int]], max_tokens: int,
                   ) -> list[tuple[float, float]]:
    """(direct-to-engine TTFT, through-the-Serve-handle TTFT) per prompt, alternating which goes
    first; both to the app's one replica."""
    from ray import serve

    from actors.engine_client import EngineClient
    from actors.replica_client import EngineDirectory
    from pipeline.params import SamplingParams
    from pipeline.protocol.engine_call import EngineCall

    (engine,) = (await EngineDirectory(app).engines()).values()
    direct = EngineClient(engine)
    handle = serve.get_deployment_handle("EngineReplica", app_name=app).options(stream=True)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def via_engine(ids: list[int]) -> float:
        t0 = time.perf_counter()
        first = None
        async for _ in direct.generate(EngineCall(f"hop-e-{uuid.uuid4().hex}", ids, params)):
            first = first or time.perf_counter() - t0
        return first

    async def via_handle(ids: list[int]) -> float:
        t0 = time.perf_counter()
        first = None
        async for _ in handle.generate.remote(EngineCall(f"hop-h-{uuid.uuid4().hex}", ids,
                                                         params)):
            first = first or time.perf_counter() - t0
        return first

    pairs = []
    for i, ids in enumerate(prompts):
        if i % 2:
            h = await via_handle(ids)
            e = await via_engine(ids[::-1])  # another prompt: no prefix-cache advantage
        else:
            e = await via_engine(ids)
            h = await via_handle(ids[::-1])
        pairs.append((e, h))
    return pairs


async def hop_call(app: str, calls: int) -> list[tuple[float, float]]:
    """(engine.health() direct, the same through the replica) round trips, alternating: the
    hop's cost without the engine's own time-to-first-token variance in it."""
    from ray import serve

    from actors.replica_client import EngineDirectory

    (engine,) = (await EngineDirectory(app).engines()).values()
    handle = serve.get_deployment_handle("EngineReplica", app_name=app)
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await engine.health.remote()
        t1 = time.perf_counter()
        await handle.health.remote()
        out.append((t1 - t0, time.perf_counter() - t1))
    return out


async def http_ttft(url: str, model: str, prompts: list[list[int]], max_tokens: int,
                    ) -> list[float]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for ids in prompts:
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            t0 = time.perf_counter()
            first = None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {") and any(
                            c.get("text") for c in json.loads(line[6:]).get("choices") or []):
                        first = time.perf_counter() - t0
            out.append(first)
    return out


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


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


def meta(args: argparse.Namespace, elapsed: float) -> dict[str, Any]:
    return {"args": vars(args), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
            "platform": platform.platform(), **tree_state(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "elapsed_s": elapsed}


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
    overrides: dict[str, Any] = {"torch_threads": args.threads}
    for item in args.set:
        key, raw = item.split("=", 1)
        overrides[key] = json.loads(raw)
    start = time.perf_counter()
    import ray

    own_ray = not ray.is_initialized()
    try:  # a failed start stops Serve too: a later app on this Ray must not find it running
        base = start_apps(args.config, args.replicas, overrides, args.cpus or args.replicas + 2)
        model = httpx.get(f"{base}/{ONE}/v1/models", timeout=30).json()["data"][0]["id"]
        warm = prompts_for(-1, 4 * args.replicas, args.prompt_len)
        for app, n in ((ONE, 1), (MANY, args.replicas)):  # first forwards on every replica
            asyncio.run(closed_loop(f"{base}/{app}", model, warm, 2 * n, 4))
        runs: list[Run] = []
        for rep in range(args.reps):
            prompts = prompts_for(rep, args.requests, args.prompt_len)
            order = [(ONE, 1), (MANY, args.replicas)]
            for app, n in order if rep % 2 == 0 else order[::-1]:
                runs.append(wave(base, app, n, rep, model, prompts, args))
                r = runs[-1]
                print(f"repeat {rep} {n} replica(s): {r.tokens_per_s:7.1f} tokens/s, "
                      f"{r.wall_s:6.2f} s, {r.cores:4.2f} cores (+ driver "
                      f"{r.driver_cpu_s / r.wall_s:4.2f}), failed {r.failed}", flush=True)
                if args.verbose:
                    print("   cores by process:", r.cores_by_role, flush=True)
        runs.sort(key=lambda r: (r.rep, r.app != ONE))
        summary = summarize(runs, args.replicas)
        bad = mismatches(runs)
        hop: dict[str, Any] = {}
        if args.hop_requests:
            hop_prompts = prompts_for(99, args.hop_requests, args.prompt_len)
            pairs = asyncio.run(hop_ttft(ONE, hop_prompts, 8))
            direct = [e * 1e3 for e, _ in pairs]
            handle = [h * 1e3 for _, h in pairs]
            diff = [h - e for e, h in zip(direct, handle)]
            http = [t * 1e3 for t in asyncio.run(http_ttft(
                f"{base}/{ONE}", model, prompts_for(98, args.hop_requests, args.prompt_len), 8))]
            calls = asyncio.run(hop_call(ONE, 4 * args.hop_requests))
            rpc = [(h - e) * 1e3 for e, h in calls]
            hop = {name: {"p50_ms": percentile(v, 0.5), "p99_ms": percentile(v, 0.99)}
                   for name, v in (("engine_ttft", direct), ("handle_ttft", handle),
                                   ("hop_added", diff), ("http_ttft", http),
                                   ("hop_call_added", rpc))}
            hop["ttft_shift"] = {q: hop["handle_ttft"][q] - hop["engine_ttft"][q]
                                 for q in ("p50_ms", "p99_ms")}
            hop["ray"] = ray.__version__
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
    result = {"meta": meta(args, elapsed), "summary": summary, "hop": hop,
              "mismatches": bad[:20],
              "runs": [{k: v for k, v in asdict(r).items() if k != "texts"} for r in runs]}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(1 if res["mismatches"] or any(
        res["summary"][k]["failed"] for k in res["summary"] if k.endswith("_replica")) else 0)
