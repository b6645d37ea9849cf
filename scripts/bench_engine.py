"""End-to-end engine benchmark: modes x workloads x batch sizes on one set of weights, with
Hugging Face `generate` (plain and prompt lookup) as the outside baseline, in one process/run.

    .venv/bin/python scripts/bench_engine.py [--max-tokens 64] [--reps 3] [--plan copy:1,8] ...

Modes: `none` (target only), `adaptive` (n-gram drafts, k chosen per request and step by
pipeline.engine.spec, up to the largest fixed k), `k2` / `k4` / `k8` (n-gram drafts, fixed
k), `model` (a draft model, adaptive), `suffix` (suffix drafts, pipeline.draft.suffix, adaptive
up to SUFFIX_K) and `suffix-fixed` (suffix drafts, k = SUFFIX_K: only the drafts' own score cuts).
SmolLM2-135M has no smaller sibling here, so the `model` draft is a STAND-IN: the target's own
weights with most layers skipped (`--draft-layers`).

Protocol: "batch b" means at most b requests in flight, closed loop as a served engine runs: a
request is submitted the moment another finishes, max(b, `--requests`) requests per repetition
(TTFT never includes queueing: a request's clock starts at its submission). tok/s is all
tokens over the whole wall time of the same work, the drain included: what a batch job of these
requests takes. "busy tok/s" is the rate while the client still had requests to submit (the
batch full; `busy_window`): a drain measures how evenly requests end, not what a step of b
requests yields (at mix batch 8 adaptive finishes the copy requests early and the chat requests
then drain at a smaller batch: 1.28 tokens a verify, only 8% fewer steps); a server under
sustained load runs busy. One-wave cells (b = requests) have no busy window. Every mode runs
the same requests of a cell, the modes interleaved repetition by repetition in a rotated order,
at batch 1 request by request (`interleaved_parts`; `--reps`, >= 3 for numbers worth quoting;
`--reps-b1` for the batch-1 cells, whose segments are short); a cell reports the median of its
repetitions and their spread. CPU time is this
process's (every thread) in-process, and the Ray processes' (the driver's descendants: raylet,
GCS, actors) for the Ray row, labelled with the cores Ray was given. Greedy outputs of every
engine run are compared with an independent reference (target-only, one request at a time,
one token per forward, in-process: `reference_outputs` in engine_bench/checks.py, sharing no
code with the engine loop), and every request's statistics must satisfy completion = 1 +
verify_ct + accepted.

Writes `<out>/results.json` (with the commit and whether the tree was dirty) and PNG plots; exits 1
(after writing them) when a greedy output differs from the reference or a request breaks the
statistics identity, printing the first case. This file runs the cells; the parts are in
scripts/engine_bench/ and the shared machinery in scripts/harness.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `scripts`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from pipeline.config import is_tiny, load_config, resolve_source
from pipeline.params import SamplingParams
from pipeline.tokenizer import eos_token_ids
from scripts.engine_bench.checks import hf_agreement, reference_mismatches, reference_outputs
from scripts.engine_bench.hf import hf_wave, load_hf
from scripts.engine_bench.local import MODES, LocalBench
from scripts.engine_bench.ray_row import run_ray
from scripts.engine_bench.report import table, targets
from scripts.engine_bench.results import RunResult, Segment, merge
from scripts.engine_bench.workloads import (
    Request,
    encode_prompt,
    interleaved_parts,
    load_workload,
    warmup_requests,
)
from scripts.harness import ROOT, parse_sets, rotated, run_meta, write_json


# --- main ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_engine.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "smollm2-cpu.yaml"))
    p.add_argument("--model", default=None, help="override the config's model (e.g. tiny:0)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (YAML value), e.g. --set weights=float")
    p.add_argument("--plan", nargs="+", default=["copy:1,8,32", "chat:1,8,32", "mix:1,8,32"],
                   help="workload:batch,batch... (a file in scripts/workloads or a .jsonl)")
    p.add_argument("--modes", nargs="+", default=["none", "adaptive", "k2", "k4", "k8"],
                   choices=MODES)
    p.add_argument("--reps", type=int, default=3, help="repetitions per cell (median, spread)")
    p.add_argument("--reps-b1", type=int, default=None,
                   help="repetitions of the batch-1 cells (default --reps): their segments are "
                        "short, so their medians need more of them (adaptive and k8 make the "
                        "same decisions there and still ran 0.87-0.99 apart per repetition)")
    p.add_argument("--requests", type=int, default=16,
                   help="requests per repetition at batch b > 1: max(b, this), b in flight")
    p.add_argument("--warm", nargs="*", default=[], metavar="WORKLOAD:N",
                   help="a workload's last N prompts, served untimed by every mode before its "
                        "cells (a running server's state: the adaptive pool, the suffix global "
                        "index); timed requests never reuse them")
    p.add_argument("--requests-b1", type=int, default=1,
                   help="requests per batch-1 wave set (batch b > 1 runs b requests)")
    p.add_argument("--max-tokens", type=int, default=64)
    # 16, not the fixed modes' largest 8: a cap costs the adaptive modes nothing where runs are
    # short (they pick k per step), and inside a copied run it halves the verifies. Copy at batch
    # 1 on an AVX2-only VM, where a 9-row forward costs 2.3x a 1-row one: 3.06 tokens a verify
    # and 1.77x target-only, against 2.73 and 1.69x with a cap of 8 (docs/benchmarks.md).
    p.add_argument("--k", type=int, default=16,
                   help="most drafts per step of the adaptive modes")
    p.add_argument("--hf-k", type=int, default=4, help="drafts per step of HF prompt lookup")
    p.add_argument("--draft-layers", default="auto",
                   help="target layers the stand-in draft keeps, e.g. 0-7,28-29")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampling (no check)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: see docs/benchmarks.md on oversubscription)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--ray-batches", type=int, nargs="*", default=[])
    p.add_argument("--ray-mode", default="adaptive", choices=MODES[:5])
    p.add_argument("--ray-workload", default="copy")
    p.add_argument("--ray-cores", type=int, default=2, help="CPUs given to the Ray cluster")
    p.add_argument("--out", default="bench-out",
                   help="folder for results.json and the plots (default bench-out, git-ignored: "
                        "results enter docs/bench only when copied there on purpose)")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if args.reps_b1 is None:
        args.reps_b1 = args.reps
    if args.reps < 1 or args.reps_b1 < 1:
        p.error("--reps and --reps-b1 must be at least 1")
    args.plan_batches = {}
    for item in args.plan:
        name, _, batches = item.rpartition(":")
        args.plan_batches[name] = [int(b) for b in batches.split(",")]
    args.batches = sorted({b for bs in args.plan_batches.values() for b in bs})
    args.workloads = list(args.plan_batches)
    args.warm = {w: int(n) for w, n in (item.split(":") for item in args.warm)}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides: dict[str, Any] = {"torch_threads": args.threads,
                                 "num_slots": max(args.batches + args.ray_batches),
                                 "max_model_len": 1024}
    if args.model:
        overrides["model"] = args.model
    overrides.update(parse_sets(args.set))
    config = load_config(args.config, overrides)
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                            seed=0 if args.temperature > 0 else None)
    t_start = time.perf_counter()
    bench = LocalBench(config, args)
    tok = bench.tokenizer
    eos = eos_token_ids(tok)
    workloads = {w: [Request(p.id, encode_prompt(tok, p.text)) for p in load_workload(w)]
                 for w in args.workloads}
    for w, n in args.warm.items():
        if w not in workloads or not 0 <= n < len(workloads[w]):
            raise SystemExit(f"--warm {w}:{n}: not a planned workload with more than {n} prompts")

    def requests_for(w: str, batch: int, rep: int) -> list[Request]:
        n = args.requests_b1 if batch == 1 else max(batch, args.requests)
        reqs = workloads[w][: len(workloads[w]) - args.warm.get(w, 0)]  # never a warm-up prompt
        return [Request(f"{reqs[(i + rep * n) % len(reqs)].rid}#{i}.{rep}",
                        reqs[(i + rep * n) % len(reqs)].ids) for i in range(n)]

    warm = [Request("warm", workloads[args.workloads[0]][0].ids)]
    warm_params = dataclasses.replace(params, max_new_tokens=32)
    for mode in args.modes:  # first forwards, the step-cost model, drafted steps: all untimed
        bench.run_wave(mode, warmup_requests(tok), warm_params)
    model_path = None if is_tiny(config.model) else resolve_source(config.model)
    hf_model = None
    if not args.no_hf and model_path is not None and 1 in args.batches:
        hf_model = load_hf(model_path)
        for mode in ("hf", "hf-pld"):  # both paths warmed before anything is timed
            hf_wave(hf_model, mode, warm, 8, args.hf_k, config.ngram_max_n, eos)
    results: list[RunResult] = []
    for w in args.workloads:
        if args.warm.get(w):  # the workload's last prompts, served untimed by every mode
            served = workloads[w][-args.warm[w]:]
            for mode in args.modes:
                bench.run_wave(mode, [Request(f"warm-{r.rid}", r.ids) for r in served], params,
                               min(8, len(served)))
        for batch in args.batches:
            if batch not in args.plan_batches[w]:
                continue
            modes: list[tuple[str, str]] = [("local", m) for m in args.modes]
            if batch == 1 and hf_model is not None:
                modes += [("hf", "hf"), ("hf", "hf-pld")]
            reps: dict[tuple[str, str], list[list[Segment]]] = {m: [] for m in modes}
            for rep in range(args.reps_b1 if batch == 1 else args.reps):
                for m in modes:
                    reps[m].append([])
                parts = interleaved_parts(requests_for(w, batch, rep), batch)
                for turn, part in enumerate(parts, rep * len(parts)):
                    # Modes interleaved, the order rotated each turn: machine noise and cache
                    # warmth hit every mode alike.
                    for engine, mode in rotated(modes, turn):
                        reps[(engine, mode)][-1].append(
                            bench.run_wave(mode, part, params, batch) if engine == "local"
                            else hf_wave(hf_model, mode, part, args.max_tokens, args.hf_k,
                                         config.ngram_max_n, eos))
            for (engine, mode), rs in reps.items():
                res = merge(engine, mode, w, batch, rs)
                results.append(res)
                print(f"[{time.perf_counter() - t_start:6.0f}s] {engine:5s} {mode:8s} {w:5s} "
                      f"b={batch:2d}: {res.tokens_per_s:7.1f} tok/s (reps "
                      f"{', '.join(f'{x:.1f}' for x in res.rep_tokens_per_s)}), tok/verify "
                      f"{res.mean_accepted_len or 0:.2f}", flush=True)
    if args.ray_batches and args.ray_workload in workloads:
        for res in run_ray(bench, config, args.ray_mode, args.ray_workload, args.ray_batches,
                           requests_for, params, args.reps, args.ray_cores):
            results.append(res)
            print(f"[{time.perf_counter() - t_start:6.0f}s] ray ({res.cores} cores) "
                  f"{args.ray_mode} {args.ray_workload} b={res.batch}: "
                  f"{res.tokens_per_s:.1f} tok/s, {res.tokens_per_cpu_s:.1f} tok/cpu-s", flush=True)
    reference: dict[str, dict[str, list[int]]] = {}
    mismatches: list[str] = []
    if args.temperature == 0:
        for w in args.workloads:
            reference[w] = reference_outputs(bench.target, {r.rid: r.ids for r in workloads[w]},
                                             args.max_tokens, eos)
        mismatches = reference_mismatches(results, reference)
    violations = [f"{r.engine}/{r.mode} {r.workload} b{r.batch} {v}"
                  for r in results for v in r.stats_violations]
    report = {
        "meta": run_meta(args, time.perf_counter() - t_start, model=config.model,
                         torch=torch.__version__, threads=torch.get_num_threads()),
        "targets": targets(results),
        "hf_agreement": hf_agreement(results, reference),
        "greedy_equals_reference": not mismatches if args.temperature == 0 else None,
        "reference_mismatches": mismatches[:20],
        "num_reference_mismatches": len(mismatches),
        "stats_identity_holds": not violations,
        "stats_violations": violations[:20],
        "requests_checked": sum(r.requests for r in results if r.engine != "hf"),
        "runs": [dataclasses.asdict(r) for r in results],
    }
    write_json(os.path.join(args.out, "results.json"), report)
    print(table(results))
    print(json.dumps(report["targets"], indent=1))
    if not args.no_plots:
        from scripts.engine_bench.plots import write_plots  # matplotlib only when plotting

        for path in write_plots(report, args.out):
            print(f"wrote {path}")
    failed = mismatches[:1] + violations[:1]
    for line in failed:
        print(f"check failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
