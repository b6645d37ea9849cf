"""What the engine adds to a step, with the model taken out: the null model
(`model: null:<forward ms>`, pipeline.models.null) at batch 1, 8, 32 and 256, in-process and
through Ray, in one run.

    .venv/bin/python scripts/bench_step_overhead.py [--batches 1 8 32 256] [--forward-ms 0]
        [--tokens 64] [--reps 3] [--draft none] [--ray-cores 2] [--out bench-out/step]

Each cell is one wave of `batch` requests (8-token prompts, `--tokens` output tokens each, the null
model never ends one early), started together and read to the end by this process as a client.
The transports take turns wave by wave, `--reps` times; a cell reports the median ms per engine
step (wall time over the engine's step count) and the spread of the repetitions. In-process, each
step is split into its parts (timed wrappers around the scheduler and the stages):

- schedule: `Scheduler.schedule` (the plan);
- draft: the draft stage (`draft_step`);
- verify: the verify stage outside the model's forward (the runner's KV bookkeeping, acceptance,
  the step message's encoding);
- forward: the model's own forward (0 with the null model, or the `--forward-ms` sleep);
- output: the output processor (decode the step message, finish checks, detokenize, deltas);
- loop: the rest (the core's loop, delivering deltas to the request streams, this client).

Through Ray, "transport" is the Ray step minus the in-process step of the same cell: the actor
hops of the step (engine -> draft -> verifier -> output -> engine) and the relay of every
request's deltas from the Engine actor to this process (one Ray message per request per step).
CPU seconds are every process's (this one, the raylet, GCS and actors) per step. Output is checked
against the null model's known greedy sequence (`pipeline.models.null.next_token`). Writes
`<out>/results.json` with the commit and whether the tree was dirty.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `actors`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.config import EngineConfig, load_config, parse_null_source
from pipeline.engine.local import build_local_engine
from pipeline.models.null import null_config
from pipeline.params import SamplingParams
from pipeline.protocol import EngineCall
from scripts.engine_bench.stages import Clock, timed_stages
from scripts.harness import (
    ROOT,
    alternated,
    markdown_table,
    null_tokens,
    parse_sets,
    spread,
    stopwatch,
    tree_cpu_s,
    tree_state,
    write_json,
)

PARTS = ("schedule", "draft", "verify", "forward", "output", "loop")
PROMPT_LEN = 8


@dataclasses.dataclass
class Wave:
    """One wave's measurements."""

    wall_s: float
    steps: int
    cpu_s: float
    tokens: int
    parts_s: dict[str, float] = dataclasses.field(default_factory=dict)
    bad_outputs: int = 0
    outputs: list[list[int]] = dataclasses.field(default_factory=list)


def bench_config(args: argparse.Namespace) -> EngineConfig:
    most = max(args.batches)
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), {
        "model": args.model or f"null:{args.forward_ms:g}", "draft": args.draft, "draft_model": None,
        "num_slots": most, "max_waiting": most, "max_model_len": PROMPT_LEN + args.tokens + 16,
        "step_timeout_s": 60, "overlap": not args.no_overlap})


def prompts(batch: int, rep: int) -> list[list[int]]:
    vocab = null_config().vocab_size
    return [[(3 + 17 * i + rep + j) % vocab for j in range(PROMPT_LEN)] for i in range(batch)]


async def wave(generate: Any, tag: str, batch: int, rep: int, tokens: int, null: bool
               ) -> tuple[int, int, list[list[int]]]:
    """Run one wave through `generate(call)` (an async iterator of deltas); (tokens, outputs
    that are not the null model's known sequence (0 for another model), the outputs)."""
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0)

    async def one(i: int, prompt: list[int]) -> list[int]:
        got: list[int] = []
        async for delta in generate(EngineCall(f"{tag}-{i}", prompt, params)):
            got.extend(delta.token_ids)
        return got

    ps = prompts(batch, rep)
    outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)))
    bad = sum(o != null_tokens(p[-1], tokens) for p, o in zip(ps, outs)) if null else 0
    return sum(len(o) for o in outs), bad, list(outs)


class InProcess:
    def __init__(self, config: EngineConfig) -> None:
        self.clock = Clock()
        self.null = parse_null_source(config.model) is not None
        self.core = build_local_engine(config, stages_type=timed_stages(self.clock))
        runner = self.core.stages.verifier.runner
        self.clock.wrap_forward(runner.model, "verify_forward")  # the model's own forward
        self.schedule_s = 0.0
        inner = self.core.scheduler.schedule

        def schedule() -> Any:
            t0 = time.perf_counter()
            try:
                return inner()
            finally:
                self.schedule_s += time.perf_counter() - t0

        self.core.scheduler.schedule = schedule

    async def generate(self, call: EngineCall) -> Any:
        async for delta in await self.core.add_request(call):
            yield delta

    def run(self, tag: str, batch: int, rep: int, tokens: int) -> Wave:
        async def go() -> tuple[int, int]:
            self.core.start()
            try:
                return await wave(self.generate, tag, batch, rep, tokens, self.null)
            finally:
                await self.core.idle()

        self.clock.times = type(self.clock.times)()
        self.schedule_s = 0.0
        steps0 = self.core.stats.steps
        with stopwatch() as took:
            n, bad, outs = asyncio.run(go())
        wall, cpu = took.wall_s, took.cpu_s
        t = self.clock.times
        parts = {"schedule": self.schedule_s, "draft": t.draft,
                 "verify": t.verify - t.verify_forward, "forward": t.verify_forward,
                 "output": t.output}
        parts["loop"] = wall - sum(parts.values())
        return Wave(wall, self.core.stats.steps - steps0, cpu, n, parts, bad, outs)


class ThroughRay:
    def __init__(self, config: EngineConfig, cores: int) -> None:
        import ray

        from actors.engine import start_engine
        from actors.engine_client import EngineClient

        ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
        self.ray = ray
        self.null = parse_null_source(config.model) is not None
        self.handle = start_engine(config)
        self.client = EngineClient(self.handle)

    def run(self, tag: str, batch: int, rep: int, tokens: int) -> Wave:
        steps0 = self.ray.get(self.handle.stats.remote())["steps"]
        with stopwatch(tree_cpu_s) as took:
            n, bad, outs = asyncio.run(wave(self.client.generate, tag, batch, rep, tokens,
                                            self.null))
        steps = self.ray.get(self.handle.stats.remote())["steps"] - steps0
        return Wave(took.wall_s, steps, took.cpu_s, n, bad_outputs=bad, outputs=outs)

    def close(self) -> None:
        from actors.engine import stop_engine

        stop_engine(self.handle)
        self.ray.shutdown()


def summarize(waves: list[Wave]) -> dict[str, Any]:
    per_step = [w.wall_s * 1e3 / max(w.steps, 1) for w in waves]
    out: dict[str, Any] = {
        "step_ms": statistics.median(per_step), "spread": spread(per_step) or 0.0,
        "steps": waves[0].steps, "tok_s": statistics.median(w.tokens / w.wall_s for w in waves),
        "cpu_ms_per_step": statistics.median(w.cpu_s * 1e3 / max(w.steps, 1) for w in waves),
        "bad_outputs": sum(w.bad_outputs for w in waves)}
    if waves[0].parts_s:
        out["parts_ms"] = {p: statistics.median(w.parts_s[p] * 1e3 / max(w.steps, 1)
                                                for w in waves) for p in PARTS}
    return out


def table(cells: dict[str, dict[str, Any]], batches: list[int]) -> str:
    rows = []
    for b in batches:
        local = cells.get(f"inproc/b{b}")
        for name in ("inproc", "ray"):
            c = cells.get(f"{name}/b{b}")
            if c is None:
                continue
            parts = c.get("parts_ms")
            cols = [f"{parts[p]:.2f}" for p in PARTS] if parts else ["-"] * len(PARTS)
            extra = f"{c['step_ms'] - local['step_ms']:.2f}" if name == "ray" and local else "-"
            rows.append([str(b), name, f"{c['step_ms']:.2f}", f"{c['spread']:.0%}",
                         f"{c['tok_s']:.0f}", f"{c['cpu_ms_per_step']:.2f}", *cols, extra])
    return markdown_table(["batch", "transport", "ms/step", "spread", "tok/s", "CPU ms/step",
                           *PARTS, "transport"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 256])
    p.add_argument("--forward-ms", type=float, default=0.0, help="the null model's forward")
    p.add_argument("--model", default=None,
                   help="a real model instead of the null one (outputs then checked between "
                        "the transports only)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--draft", default="none", choices=["none", "ngram", "suffix"])
    p.add_argument("--no-overlap", action="store_true", help="overlap: false")
    p.add_argument("--transports", nargs="+", default=["inproc", "ray"],
                   choices=["inproc", "ray"])
    p.add_argument("--ray-cores", type=int, default=2, help="CPUs given to the Ray cluster")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for both transports (YAML value)")
    p.add_argument("--out", default=os.path.join("bench-out", "step"))
    args = p.parse_args(argv)
    config = bench_config(args)
    overrides = parse_sets(args.set)
    if overrides:
        config = dataclasses.replace(config, **overrides)
    runners: dict[str, Any] = {}
    if "inproc" in args.transports:
        runners["inproc"] = InProcess(config)
    if "ray" in args.transports:
        runners["ray"] = ThroughRay(config, args.ray_cores)
    waves: dict[str, list[Wave]] = {}
    try:
        for name, r in runners.items():  # warm: first calls, imports, actor paths
            r.run(f"warm-{name}", min(2, max(args.batches)), 0, 4)  # within max_waiting
        for rep in range(args.reps):
            for b in args.batches:
                for name in alternated(list(runners), rep):
                    waves.setdefault(f"{name}/b{b}", []).append(
                        runners[name].run(f"{name}{b}.{rep}", b, rep, args.tokens))
    finally:
        if "ray" in runners:
            runners["ray"].close()
    cells = {k: summarize(v) for k, v in waves.items()}
    bad = sum(c["bad_outputs"] for c in cells.values())
    # any model: the transports' greedy outputs of the same wave agree
    for b in args.batches:
        runs = [waves[f"{name}/b{b}"] for name in runners]
        bad += sum(x.outputs != y.outputs for ws in zip(*runs) for x, y in itertools.pairwise(ws))
    print(table(cells, args.batches))
    write_json(os.path.join(args.out, "results.json"),
               {"cells": cells, "args": vars(args), "tree": tree_state(),
                "config": {"model": config.model, "draft": config.draft,
                           "overlap": config.overlap}}, indent=2)
    if bad:
        print(f"{bad} outputs differ from the null model's greedy sequence or between the "
              "transports", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
