"""Benchmark the adaptive controller's own cost per decode step (pipeline.engine.spec.policy).

    .venv/bin/python scripts/bench_spec_control.py [--batches 8 32] [--steps 500] [--repeats 5]
        [--trace]

Each step is what the engine asks of the controller: `choose` (k per request), `min_gains` and
`observe` (the step's outcome). The batch is synthetic and seeded: up to 16 drafts a request,
drafts verified 0, 2, 4 or 8 at random, some of them kept, step times from a linear cost. The
controller is warmed for 40 steps first, so its cost model is known and its rows measured (no
explore steps). Prints the median over repeats of the per-step time, as wall time and as this
process's CPU time, with the spread ((max - min) / median), the commit and whether the tree was
dirty. The controller runs on the engine's thread between forwards, so every microsecond here is
added to every step.

`--trace` adds what a sampled engine step adds on top (pipeline.engine.core `_start_span`): a
recording span (SDK tracer, spans dropped at export) carrying the decision record as
`spec.control.*` attributes, measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from pipeline.engine.spec.policy import SpecController
from pipeline.engine.spec.record import span_attributes
from pipeline.spec_settings import SpecSettings
from scripts.harness import discarding_tracer_provider, spread, stopwatch, tree_state

MAX_K = 16


def step(c: SpecController, rids: list[str], rng: random.Random, tracer=None) -> None:
    ks = c.choose(rids, [MAX_K] * len(rids))
    if tracer is not None:
        span = tracer.start_span("spec.engine_step", attributes={"spec.step": 0})
        if span.is_recording():
            span.set_attributes(span_attributes(c.decision(), []))
        span.end()
    c.min_gains(rids)
    drafted = [min(k, rng.choice([0, 0, 2, 4, 8])) for k in ks]
    kept = [1 + rng.randint(0, d) for d in drafted]
    seconds = 0.08 + 0.003 * sum(drafted) + 0.01 * (max(drafted) > 0)
    c.observe(rids, drafted, kept, seconds)


def measure(batch: int, steps: int, seed: int, tracer=None) -> tuple[float, float]:
    """(wall ms, CPU ms) per step of one warmed controller."""
    rng = random.Random(seed)
    c = SpecController(SpecSettings(mode="adaptive", num_speculative_tokens=MAX_K))
    rids = [f"r{i}" for i in range(batch)]
    for _ in range(40):
        step(c, rids, rng)
    with stopwatch() as took:
        for _ in range(steps):
            step(c, rids, rng, tracer)
    return took.wall_s * 1e3 / steps, took.cpu_s * 1e3 / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trace", action="store_true",
                    help="also a sampled engine step span with the decision attributes")
    args = ap.parse_args(argv)
    tracer = discarding_tracer_provider(1.0).get_tracer("specrelay") if args.trace else None
    out: dict = {**tree_state(), "batches": {}}
    for b in args.batches:
        runs = [measure(b, args.steps, seed, tracer) for seed in range(args.repeats)]
        wall, cpu = ([r[i] for r in runs] for i in (0, 1))
        out["batches"][b] = {"wall_ms_per_step": statistics.median(wall),
                             "cpu_ms_per_step": statistics.median(cpu), "spread": spread(wall)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
