"""Ms per token through Ray for each step transport (`step_transport: calls | compiled`): one
engine per transport on the tiny config (configs/tiny.yaml, `draft: none` unless --draft), one
request at a time streaming --tokens tokens (ignore_eos), --repeats times after a warm-up; the
median request's ms per token. A tiny model's step costs next to nothing, so this is the
transport's own cost per step.

    python scripts/bench_step_transport.py [--tokens 200] [--repeats 3] [--draft none]
                                           [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from actors.engine import start_engine, stop_engine
from actors.engine_client import EngineClient
from pipeline.config import STEP_TRANSPORTS, load_config
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall
from scripts.harness import parse_sets


async def one_request(client: EngineClient, rid: str, tokens: int) -> float:
    """Seconds per output token of one streamed request."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    got = 0
    async for delta in client.generate(EngineCall(rid, [1, 5, 9, 14], params)):
        got += len(delta.token_ids)
    assert got == tokens, (got, tokens)
    return (time.perf_counter() - start) / tokens


def measure(transport: str, args: argparse.Namespace) -> dict:
    overrides = {"draft": args.draft, **parse_sets(args.set)}
    config = load_config("configs/tiny.yaml", {**overrides, "step_transport": transport})
    handle = start_engine(config)
    try:
        client = EngineClient(handle)

        async def main() -> list[float]:
            await one_request(client, f"{transport}-warm", 20)
            return [await one_request(client, f"{transport}-{i}", args.tokens)
                    for i in range(args.repeats)]

        per_token = asyncio.run(main())
    finally:
        stop_engine(handle)
    return {"transport": transport, "ms_per_token": round(statistics.median(per_token) * 1e3, 3),
            "runs_ms_per_token": [round(s * 1e3, 3) for s in per_token]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft", default="none")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another config override (YAML value), e.g. overlap=false")
    ap.add_argument("--transports", nargs="+", default=list(STEP_TRANSPORTS),
                    choices=STEP_TRANSPORTS)
    args = ap.parse_args(argv)
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for transport in args.transports:
            print(json.dumps(measure(transport, args)), flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
