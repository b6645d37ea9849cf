"""Replay n-gram drafting over recorded greedy outputs: what a match of each length keeps, and
what each `ngram_min_n` would gain at batch 1 for given step costs. No model runs: with greedy
decoding a draft is accepted exactly while it equals the recorded output.

    .venv/bin/python scripts/replay_ngram.py [--results docs/bench/matrix-2026-12-05.json]
        [--workloads copy chat] [--k 8] [--max-n 4] [--costs 2:1.71 3:1.66 5:1.82 9:2.03]

The outputs are the batch-1 target-only run's of the results file (`bench_engine.py`); `--costs`
gives a verify forward of r rows as a multiple of a plain decode (measured with
`scripts/bench_model.py`; interpolated between the points). Step costs outside the forward are
left out, so the speedups are upper bounds of what the engine shows; their order is the point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipeline.draft.ngram_lookup import propose_ngram
from pipeline.model_files import smollm2_path
from pipeline.tokenizer import load_tokenizer
from scripts.engine_bench.workloads import encode_prompt, load_workload


def accepted(drafts: list[int], out: list[int], j: int) -> int:
    """Drafts proposed at output position j that greedy decoding keeps."""
    n = 0
    while n < len(drafts) and j + n < len(out) and drafts[n] == out[j + n]:
        n += 1
    return n


def match_length(tokens: np.ndarray, k: int, max_n: int) -> int:
    """The longest suffix n-gram (<= max_n) with an earlier occurrence: what the proposer uses."""
    for n in range(max_n, 0, -1):
        if propose_ngram(tokens, k, n, n):
            return n
    return 0


def by_match_length(pairs: list[tuple[list[int], list[int]]], k: int,
                    max_n: int) -> dict[int, list[int]]:
    """Per match length, the tokens k drafts keep at every output position."""
    kept: dict[int, list[int]] = {}
    for prompt, out in pairs:
        for j in range(len(out)):
            t = np.array(prompt + out[:j])
            kept.setdefault(match_length(t, k, max_n), []).append(
                accepted(propose_ngram(t, k, 1, max_n), out, j))
    return kept


def replay(pairs: list[tuple[list[int], list[int]]], k: int, min_n: int, max_n: int,
           cost: Callable[[int], float]) -> float:
    """Tokens per plain-decode time when every step drafts up to k after a match of >= min_n."""
    tokens = time = 0.0
    for prompt, out in pairs:
        j = 0
        while j < len(out):
            drafts = propose_ngram(np.array(prompt + out[:j]), k, min_n, max_n)
            time += cost(len(drafts) + 1) if drafts else 1.0
            j += accepted(drafts, out, j) + 1
        tokens += len(out)
    return tokens / time


def oracle(pairs: list[tuple[list[int], list[int]]], k: int, max_n: int,
           cost: Callable[[int], float]) -> float:
    """The best any choice of k per step could do, knowing each step's outcome (an upper bound)."""
    tokens = time = 0.0
    for prompt, out in pairs:
        n = len(out)
        kept = []  # per position: (drafts proposed, drafts kept)
        for j in range(n):
            drafts = propose_ngram(np.array(prompt + out[:j]), k, 1, max_n)
            kept.append((len(drafts), accepted(drafts, out, j)))
        best = [0.0] * (n + 1)  # best[j]: least time from position j to the end
        for j in range(n - 1, -1, -1):
            drafted, keep = kept[j]
            best[j] = min([1.0 + best[j + 1]] + [cost(d + 1) + best[min(n, j + min(keep, d) + 1)]
                                                 for d in range(1, drafted + 1)])
        tokens += n
        time += best[0]
    return tokens / time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results",
                   default=os.path.join(ROOT, "docs", "bench", "matrix-2026-12-05.json"))
    p.add_argument("--workloads", nargs="+", default=["copy", "chat"])
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--max-n", type=int, default=4)
    p.add_argument("--costs", nargs="+", default=["2:1.71", "3:1.66", "5:1.82", "9:2.03"],
                   help="rows:multiple of a plain decode")
    args = p.parse_args(argv)
    points = sorted((int(r), float(c)) for r, c in (x.split(":") for x in args.costs))
    rows, mult = [1] + [r for r, _ in points], [1.0] + [c for _, c in points]

    def cost(r: int) -> float:
        return float(np.interp(r, rows, mult))

    with open(args.results) as f:
        runs = json.load(f)["runs"]
    tokenizer = load_tokenizer(smollm2_path())
    for workload in args.workloads:
        run = next(r for r in runs if r["workload"] == workload and r["mode"] == "none"
                   and r["batch"] == 1 and r["engine"] == "local")
        prompts = {q.id: encode_prompt(tokenizer, q.text) for q in load_workload(workload)}
        pairs = [(prompts[key.split("#")[0]], out) for key, out in run["outputs"].items()]
        kept = by_match_length(pairs, args.k, args.max_n)
        print(f"{workload}: {len(pairs)} outputs; tokens {args.k} drafts keep, by match length")
        for n, v in sorted(kept.items()):
            print(f"  match {n}: {len(v):4d} positions, mean kept {np.mean(v):.2f}")
        if workload in ("copy", "mix"):
            speed = {m: replay(pairs, args.k, m, args.max_n, cost) for m in range(1, args.max_n + 1)}
            print("  replayed speedup over target-only by min_n: "
                  + ", ".join(f"{m}: {s:.2f}x" for m, s in speed.items())
                  + f"; oracle {oracle(pairs, args.k, args.max_n, cost):.2f}x")


if __name__ == "__main__":
    main()
