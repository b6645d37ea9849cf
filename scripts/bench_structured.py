"""What grammar-constrained neighbours cost unconstrained requests (issue 16), in-process, tiny
models, n-gram drafts: 20 free requests run next to 50 constrained ones (five JSON schemas, a
regex, a choice) and next to 50 free ones of the same lengths; prints their median latency and
the ratio (reported as numbers, not asserted)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import torch

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `scripts`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine
from pipeline.grammar.llg import compile_grammar
from pipeline.models.runners import tiny_tokenizer
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall
from scripts.harness import interleaved

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["ok", "n"]},
    {"type": "object", "properties": {"tag": {"enum": ["red", "green", "blue"]}},
     "required": ["tag"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    {"type": "object", "properties": {"w": {"type": "string", "maxLength": 6}}, "required": ["w"]},
    {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
]


async def latencies(core, requests) -> dict[str, float]:
    async def one(rid, prompt, params):
        t0 = time.perf_counter()
        stream = await core.add_request(EngineCall(rid, prompt, params))
        n = 0
        async for d in stream:
            n += len(d.token_ids)
        return rid, time.perf_counter() - t0, n

    core.start()
    out = await asyncio.gather(*(one(*r) for r in requests))
    await core.stop()
    return {rid: (t, n) for rid, t, n in out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = tiny_tokenizer()
    grammars = ([compile_grammar("json_schema", s, tok) for s in SCHEMAS]
                + [compile_grammar("regex", r"[a-z]{2,6}-[0-9]{2}", tok),
                   compile_grammar("choice", ["alpha", "beta", "gamma"], tok)])
    free = [(f"u{i}", [30 + i, 31], SamplingParams(max_new_tokens=32, ignore_eos=True))
            for i in range(20)]
    constrained = [(f"g{i}", [5 + i % 40, 6, 7], SamplingParams(
        max_new_tokens=32, grammar=grammars[i % len(grammars)])) for i in range(50)]
    cfg = load_config("configs/tiny.yaml", {"draft": "ngram", "num_slots": 80, "max_waiting": 256})
    # Neighbour lengths: what the constrained ones produce (measured once).
    lengths = {r: n for r, (_, n) in asyncio.run(
        latencies(build_local_engine(cfg), constrained)).items()}
    plain = [(rid, p, SamplingParams(max_new_tokens=lengths[rid], ignore_eos=True))
             for rid, p, _ in constrained]
    neighbours = {"plain": plain, "constrained": constrained}

    def free_median(name: str, _rep: int) -> float:
        lat = asyncio.run(latencies(build_local_engine(cfg), free + neighbours[name]))
        return statistics.median(lat[r[0]][0] for r in free)

    # plain, then constrained, in every repetition (the order this benchmark has always used)
    rows = interleaved(list(neighbours), args.reps, free_median, order=lambda arms, _rep: arms)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(json.dumps({"free_median_latency_s": med, "runs": rows,
                      "ratio_constrained_vs_plain": med["constrained"] / med["plain"]}))


if __name__ == "__main__":
    main()
