"""Suffix drafting costs, no model: per-step propose time at several global index sizes, the
insert cost of a finished request, and the process RSS over many synthetic requests.

    .venv/bin/python scripts/bench_suffix.py [--sizes 1000 100000 1000000] [--requests 10000]

The synthetic traffic reuses a pool of "documents" (random token runs) so lookups find real
matches: each request's prompt ends with a slice of one document and its output continues it,
which is the agentic pattern (the same file rewritten across requests) the index is for.
Per-step numbers are one request's propose (own index + global index lookup), median and p99
over `--steps` lookups; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from actors.draft import DraftWorker
from pipeline.config import EngineConfig, load_config
from pipeline.draft.suffix import SuffixProposer, SuffixSettings
from pipeline.params import SamplingParams
from pipeline.protocol import NewRequest, StepPlan, encode_plan
from scripts.harness import stopwatch

GREEDY = SamplingParams(max_new_tokens=1024)  # sizes the per-request index as the engine would


class Traffic:
    """Requests over a pool of documents: prompt = 64 random tokens + a document slice, output =
    the slice's next `out_len` tokens with 5% of tokens changed (an edit)."""

    def __init__(self, seed: int, vocab: int = 49152, docs: int = 200, doc_len: int = 2000
                 ) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.docs = self.rng.integers(0, vocab, (docs, doc_len))

    def request(self, out_len: int = 128) -> tuple[list[int], list[int]]:
        doc = self.docs[self.rng.integers(len(self.docs))]
        at = int(self.rng.integers(64, len(doc) - out_len))
        prompt = np.concatenate([self.rng.integers(0, self.vocab, 64), doc[at - 64:at]])
        out = doc[at:at + out_len].copy()
        edits = self.rng.random(out_len) < 0.05
        out[edits] = self.rng.integers(0, self.vocab, int(edits.sum()))
        return prompt.tolist(), out.tolist()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fill(p: SuffixProposer, traffic: Traffic, tokens: int, rid_base: str) -> int:
    """Finish requests until `tokens` tokens went into the global index; returns how many."""
    n = 0
    while p.global_index.end < tokens:
        prompt, out = traffic.request()
        rid = f"{rid_base}{n}"
        p.add(rid, prompt, GREEDY)
        p.commit(rid, out)
        p.remove(rid)
        n += 1
    return n


def step_cost(size: int, steps: int, k: int, seed: int) -> dict:
    settings = SuffixSettings(global_tokens=size, global_requests=10**9, max_model_len=4096)
    p = SuffixProposer(settings)
    traffic = Traffic(seed)
    with stopwatch() as took:
        used = fill(p, traffic, size, "fill")
    fill_s = took.wall_s
    times, drafted, commit_times = [], [], []
    prompt, out = traffic.request(out_len=steps + 8)
    p.add("probe", prompt, GREEDY)
    for i in range(steps):
        t = time.perf_counter()
        proposal = p.propose(["probe"], [k])
        times.append(time.perf_counter() - t)
        drafted.append(len(proposal.tokens[0]))
        t = time.perf_counter()
        p.commit("probe", [out[i]])
        commit_times.append(time.perf_counter() - t)
    times_us = sorted(x * 1e6 for x in times)
    return {
        "index_tokens": len(p.global_index), "index_requests": p.global_index.num_runs,
        "index_mb": round(p.global_index.nbytes / 2**20, 1),
        "finish_us_per_request": round(fill_s / used * 1e6, 1),  # add + commit + remove
        "finish_us_per_token": round(fill_s / p.global_index.end * 1e6, 2),
        "propose_us_p50": round(statistics.median(times_us), 1),
        "propose_us_p99": round(times_us[int(0.99 * (len(times_us) - 1))], 1),
        "commit_us_p50": round(statistics.median(commit_times) * 1e6, 1),
        "mean_drafted": round(statistics.fmean(drafted), 2), "k": k,
    }


def rss_growth(requests: int, seed: int, config: EngineConfig, use_ray: bool = False,
               batch: int = 8) -> dict:
    """Drive the draft actor with step plans: `batch` requests in flight, 4 tokens committed
    per step, finished ones released (which feeds the global index). `use_ray`: the real Ray
    actor (its own process, RSS read inside it); otherwise its class in this process."""
    if use_ray:
        import ray

        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
        actor = ray.remote(DraftWorker).remote(config)

        def propose(plan: StepPlan) -> None:
            ray.get(actor.propose.remote(encode_plan(plan)))

        def rss() -> float:
            return ray.get(actor.__ray_call__.remote(lambda _self: rss_mb()))

        def index_stats() -> dict:
            return ray.get(actor.__ray_call__.remote(lambda w: _index_stats(w.proposer)))
    else:
        worker = DraftWorker(config)
        rss = rss_mb

        def propose(plan: StepPlan) -> None:
            worker.propose(encode_plan(plan))

        def index_stats() -> dict:
            return _index_stats(worker.proposer)

    traffic = Traffic(seed)
    live: dict[str, list[int]] = {}  # rid -> output tokens still to commit
    sizes: dict[str, list[int]] = {}  # rid -> [prompt length, outputs committed]
    release: list[str] = []
    started = finished = step = 0
    marks: dict[int, float] = {}
    start_rss = rss()
    while finished < requests:
        plan = StepPlan(step=step, release=release)
        release = []
        for rid, rest in list(live.items()):
            plan.commits[rid] = rest[:4]
            del rest[:4]
            sizes[rid][1] += len(plan.commits[rid])
            if rest:
                prompt_len, outputs = sizes[rid]
                plan.decode.append(rid)
                plan.last_tokens.append(plan.commits[rid][-1])  # the newest, not yet in KV
                plan.kv_lens.append(prompt_len + outputs - 1)
                plan.num_outputs.append(outputs)
                plan.ks.append(config.num_speculative_tokens)
            else:
                release.append(rid)
                del live[rid], sizes[rid]
                finished += 1
                if finished % max(1, requests // 5) == 0:
                    marks[finished] = round(rss(), 1)
        while len(live) < batch and started < requests:
            prompt, out = traffic.request(out_len=int(traffic.rng.integers(16, 256)))
            rid = f"r{started}"
            plan.new.append(NewRequest(rid, prompt, GREEDY))
            live[rid] = out
            sizes[rid] = [len(prompt), 0]
            started += 1
        propose(plan)
        step += 1
    out = {"ray_actor": use_ray, "requests": requests, "steps": step,
           "rss_mb_start": round(start_rss, 1), "rss_mb_after": marks, **index_stats(),
           "limit_tokens": config.suffix_global_tokens,
           "limit_requests": config.suffix_global_requests}
    if use_ray:
        ray.shutdown()
    return out


def _index_stats(proposer: SuffixProposer) -> dict:
    index = proposer.global_index
    return {"index_tokens": len(index), "index_requests": index.num_runs,
            "index_mb": round(index.nbytes / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ray", action="store_true", help="RSS of a real Ray draft actor")
    ap.add_argument("--rss-only", action="store_true")
    args = ap.parse_args()
    report = {} if args.rss_only else {
        "step_cost": [step_cost(s, args.steps, args.k, args.seed) for s in args.sizes]}
    config = load_config(None, {"draft": "suffix", "num_speculative_tokens": args.k,
                                "max_model_len": 4096})
    report["rss"] = rss_growth(args.requests, args.seed, config, args.ray)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
