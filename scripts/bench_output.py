"""Benchmark the output path (pipeline.output.OutputProcessor) on 256 requests x 5-token windows.

    .venv/bin/python scripts/bench_output.py [--requests 256] [--window 5] [--skip-scaling] [--trace]
    .venv/bin/python scripts/bench_output.py --trace-overhead [--trace-ratio 0.1] [--pairs 10]
        [--actor-step]

Prints accepted tokens/s through `process` (msgpack decode + validation + ids, finish checks and the
logprob boundary), then the same with detokenization (SmolLM2 tokenizer), 2 stop strings and top-5
logprobs, then the per-step cost once every request already has 100 / 10,000 / 100,000 output tokens.

Payloads are encoded before timing. Timings are the median over repeats of a block of steps, as wall
time and as this process's CPU time (on a shared machine the CPU time is the steadier number; it
counts the tokenizer's threads too). TOKENIZERS_PARALLELISM defaults to false here: one step's batch
decode is ~1 us per request, too small for the tokenizer's thread pool to pay off (set it to true in
the environment to compare). `make_processor` is the one place that builds the processor under test, so
a traced variant (pipeline.output.spans.TracedOutputProcessor) is a one-line change there.
The garbage collector is set as in the output actor (pipeline.gc_tuning); `--gc default` keeps
CPython's settings, for comparison. The first line printed names the commit (and "dirty" when
tracked files differ from it).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace

import numpy as np

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pipeline.gc_tuning import tune_gc
from pipeline.model_files import smollm2_path
from pipeline.output.delta_codec import encode_deltas
from pipeline.output.processor import OutputProcessor
from pipeline.params import SamplingParams
from pipeline.protocol import StepColumns, encode_columns
from pipeline.tokenizer import load_tokenizer
from scripts.harness import alternated, commit_label, discarding_tracer_provider, stopwatch

STOPS = ["Observation:", "<|END|>"]
EOS = [2]
LENGTHS = (100, 10_000, 100_000)


def make_processor(tokenizer, args: argparse.Namespace) -> tuple[object, Callable[[], object]]:
    """The processor under test (wrap it here, e.g. in a TracedOutputProcessor, for --trace) and
    a flush of its span processor (a no-op untraced)."""
    if not args.trace:
        return OutputProcessor(tokenizer, EOS), lambda: None
    # --trace: spans at the given sampling ratio through a BatchSpanProcessor into an exporter that
    # drops them, so this measures recording, not export; `--trace-export otlp` also encodes each
    # batch as an OTLP exporter would (protobuf bytes, then dropped: no network). Lazy: without
    # --trace the measured process has no opentelemetry loaded, as an untraced output actor has.
    from pipeline.output.spans import TracedOutputProcessor

    provider = discarding_tracer_provider(args.trace_ratio, otlp=args.trace_export == "otlp")
    proc = TracedOutputProcessor(OutputProcessor(tokenizer, EOS), provider.get_tracer("specrelay"))
    return proc, provider.force_flush


def smollm2_tokenizer():
    try:
        return load_tokenizer(smollm2_path())
    except FileNotFoundError as e:
        raise SystemExit(f"{e}: run `make install`") from None


def text_token_pool(tokenizer, rng: np.random.Generator) -> np.ndarray:
    """Ids of ordinary text: tokens of a sample text (words, punctuation, multibyte pieces)."""
    sample = (
        "The quick brown fox jumps over the lazy dog. Observations: 42, 3.14; café naïve 世界 🎉. "
        "def f(x):\n    return x * 2\n# END of the example, <b>bold</b> and more text here."
    )
    if tokenizer is None:
        return rng.integers(100, 40_000, size=512)
    return np.array(sorted(set(tokenizer.encode(sample, add_special_tokens=False))))


def step_columns(
    rids: list[str],
    pool: np.ndarray,
    window: int,
    steps: int,
    step0: int,
    top_n: int | None,
    rng: np.random.Generator,
) -> list[StepColumns]:
    """`steps` verify steps: every request gets `window` tokens (window - 1 drafts)."""
    b = len(rids)
    out = []
    for s in range(steps):
        n = b * window
        top_ids = top_lps = tn = None
        if top_n is not None:
            tn = np.full(b, top_n, dtype=np.int64)
            top_ids = rng.integers(0, 49_152, size=n * top_n)
            top_lps = -rng.random(n * top_n)
        out.append(StepColumns(
            step=step0 + s,
            rids=rids,
            lengths=np.full(b, window, dtype=np.int64),
            drafted=np.full(b, window - 1, dtype=np.int64),
            tokens=pool[rng.integers(0, len(pool), size=n)].astype(np.int64),
            logprobs=-rng.random(n),
            top_n=tn,
            top_ids=top_ids,
            top_logprobs=top_lps,
            time=1.0,
        ))
    return out


def payloads(rids, pool, window, steps, step0, top_n, rng) -> list[bytes]:
    """`step_columns`, encoded."""
    return [encode_columns(c) for c in step_columns(rids, pool, window, steps, step0, top_n, rng)]


def setup(tokenizer, args, params: SamplingParams, prefix: str):
    proc, _ = make_processor(tokenizer, args)
    return proc, add_requests(proc, args.requests, params, prefix)


def add_requests(proc, n: int, params: SamplingParams, prefix: str) -> list[str]:
    rids = [f"{prefix}-{i}" for i in range(n)]
    for rid in rids:
        proc.add_request(rid, [1, 2, 3], params)
    return rids


def catch_up(proc, rids, pool, length: int, window: int, top_n, rng) -> int:
    """Grow every request's output to `length` tokens with the benchmark's own window shape (so the
    state, e.g. the acceptance histogram, is what a real request of that length has); cycles a few
    pre-encoded payloads. Returns the next step id."""
    cycle = payloads(rids, pool, window, 16, 0, top_n, rng)
    for s in range(length // window):
        proc.process(cycle[s % len(cycle)])
    return length // window


def time_block(proc, block: list[bytes], flush: Callable[[], object] = lambda: None
               ) -> tuple[float, float]:
    """Seconds per step: (wall, CPU); `flush` (timed too) ends the block."""
    with stopwatch() as took:
        for p in block:
            proc.process(p)
        flush()
    return took.wall_s / len(block), took.cpu_s / len(block)


def median_times(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(w for w, _ in samples), statistics.median(c for _, c in samples)


def throughput(tokenizer, args, params, top_n, label: str) -> float:
    rng = np.random.default_rng(0)
    pool = text_token_pool(tokenizer, rng)
    proc, rids = setup(tokenizer, args, params, label)
    blocks = [
        payloads(rids, pool, args.window, args.steps, 1 + r * args.steps, top_n, rng)
        for r in range(args.repeats)
    ]
    proc.process(payloads(rids, pool, 1, 1, 0, top_n, rng)[0])  # warm-up (prefill-like step)
    wall, cpu = median_times([time_block(proc, b) for b in blocks])
    assert proc.num_requests == len(rids), "a request finished during the benchmark"
    tokens = len(rids) * args.window
    print(
        f"{label}: {tokens / wall:,.0f} accepted tokens/s wall ({wall * 1e3:.3f} ms/step), "
        f"{tokens / cpu:,.0f} per CPU-second ({cpu * 1e3:.3f} ms/step)"
    )
    return tokens / wall


class ActorStep:
    """A step as the output actor runs it (actors/output.py, `OutputActor.process`): the
    processor, then the step's deltas encoded for the engine (Ray's call itself not counted)."""

    def __init__(self, proc) -> None:
        self.proc = proc

    def process(self, payload: bytes) -> bytes:
        return encode_deltas(self.proc.process(payload))


def engine_traceparent(rnd: random.Random, ratio: float) -> str:
    """The W3C traceparent a traced engine puts in every step message (its step span's), sampled
    with probability `ratio` as the engine's own sampler would (its step spans are roots)."""
    flags = "01" if rnd.random() < ratio else "00"
    return f"00-{rnd.getrandbits(127) + 1:032x}-{rnd.getrandbits(63) + 1:016x}-{flags}"


def trace_overhead(tokenizer, args, params, top_n, label: str) -> float:
    """Paired: an untraced and a traced processor in one process, over the same requests and the
    same steps, blocks alternating (so machine noise hits both alike); a warm-up pair first. What
    differs is what tracing changes in a deployment: the traced arm's steps carry a traceparent
    each, sampled at the same ratio, as a traced engine's do (the output span follows it); the
    untraced arm's carry none. Each traced block ends with a flush of its span processor inside
    the timed region, so handing the block's spans on (and, with `--trace-export otlp`, encoding
    them) and freeing them is counted in the traced arm, never in the untraced one. With
    `--actor-step` a step is timed as the output actor runs it (`ActorStep`). Returns the median
    over pairs of traced / untraced CPU time a step."""
    rng, rnd = np.random.default_rng(0), random.Random(0)
    pool = text_token_pool(tokenizer, rng)
    arms = []
    for trace in (False, True):
        arm = argparse.Namespace(**{**vars(args), "trace": trace})
        proc, flush = make_processor(tokenizer, arm)
        rids = add_requests(proc, args.requests, params, label)  # the same ids in both arms
        arms.append((proc, flush))
    warm = step_columns(rids, pool, 1, 1, 0, top_n, rng)[0]
    for proc, flush in arms:
        proc.process(encode_columns(warm))
    pairs = args.pairs if args.pairs is not None else 2 * args.repeats
    samples: list[list[tuple[float, float]]] = [[], []]
    for r in range(pairs + 1):
        cols = step_columns(rids, pool, args.window, args.steps, 1 + r * args.steps, top_n, rng)
        tps = [engine_traceparent(rnd, args.trace_ratio) for _ in cols]
        blocks = ([encode_columns(c) for c in cols],
                  [encode_columns(replace(c, traceparent=tp)) for c, tp in zip(cols, tps)])
        for k in alternated((0, 1), r):
            proc, flush = arms[k]
            timed = time_block(ActorStep(proc) if args.actor_step else proc, blocks[k], flush)
            if r:  # pair 0 warms up
                samples[k].append(timed)
    c0, c1 = (statistics.median(c for _, c in s) for s in samples)
    ratio = [t[1] / u[1] for u, t in zip(*samples)]
    wall = statistics.median(t[0] / u[0] for u, t in zip(*samples))
    med = statistics.median(ratio)
    if args.actor_step:
        label += ", actor step (process + encode deltas)"
    print(f"{label}: untraced {c0 * 1e3:.3f} ms/step, traced (ratio {args.trace_ratio}) "
          f"{c1 * 1e3:.3f} ms/step (CPU, medians); traced/untraced over {pairs} pairs: "
          f"{100 * (min(ratio) - 1):+.1f}% to {100 * (max(ratio) - 1):+.1f}%, "
          f"wall {100 * (wall - 1):+.1f}%, median {100 * (med - 1):+.1f}% CPU")
    return med


def length_scaling(tokenizer, args, params, top_n, label: str) -> list[float]:
    rng = np.random.default_rng(1)
    pool = text_token_pool(tokenizer, rng)
    procs = []
    for length in LENGTHS:
        proc, rids = setup(tokenizer, args, params, f"{label}{length}")
        step = catch_up(proc, rids, pool, length, args.window, top_n, rng)
        assert proc.num_requests == len(rids), "a request finished while catching up"
        blocks = [
            payloads(
                rids, pool, args.window, args.scale_steps, step + r * args.scale_steps, top_n, rng
            )
            for r in range(args.repeats)
        ]
        procs.append((proc, blocks))
    gc.collect()
    times: list[list[tuple[float, float]]] = [[] for _ in LENGTHS]
    for r in range(args.repeats):  # interleaved, so load changes hit every length alike
        for k, (proc, blocks) in enumerate(procs):
            times[k].append(time_block(proc, blocks[r]))
    med = [median_times(t) for t in times]
    cells = ", ".join(
        f"{n:,}: {w * 1e3:.3f} ms wall / {c * 1e3:.3f} ms CPU" for n, (w, c) in zip(LENGTHS, med)
    )
    print(
        f"{label} per-step cost by output length {cells} "
        f"(100k/100: {med[-1][0] / med[0][0]:.2f}x wall, {med[-1][1] / med[0][1]:.2f}x CPU)"
    )
    return [c for _, c in med]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100, help="steps per timed block")
    ap.add_argument("--scale-steps", type=int, default=20, help="steps per block, length test")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--trace", action="store_true", help="TracedOutputProcessor, spans discarded")
    ap.add_argument("--trace-ratio", type=float, default=1.0, help="sampling ratio for --trace")
    ap.add_argument("--trace-export", choices=("discard", "otlp"), default="discard",
                    help="discard: spans dropped at export (recording only); otlp: encoded to "
                         "OTLP protobuf first, as an OTLP exporter does, then dropped")
    ap.add_argument("--pairs", type=int, default=None,
                    help="--trace-overhead: untraced/traced block pairs (default 2 x --repeats)")
    ap.add_argument("--trace-overhead", action="store_true",
                    help="only the paired traced-vs-untraced comparison (at --trace-ratio)")
    ap.add_argument("--actor-step", action="store_true",
                    help="--trace-overhead: time a step as the output actor runs it (process, "
                         "then encode the deltas for the engine)")
    ap.add_argument("--gc", choices=("tuned", "default"), default="tuned",
                    help="tuned: the output actor's GC settings (pipeline.gc_tuning); "
                         "default: CPython's")
    args = ap.parse_args()
    big = 1 << 20  # no request reaches the length limit during the benchmark
    ids_params = SamplingParams(max_new_tokens=big, logprobs=0)
    text_params = SamplingParams(max_new_tokens=big, stop=STOPS, logprobs=5)
    tok = smollm2_tokenizer()
    if args.gc == "tuned":
        tune_gc()
    print(f"{args.requests} requests x {args.window}-token windows, GC {args.gc}, "
          f"{commit_label()}")
    if args.trace_overhead:
        trace_overhead(None, args, ids_params, None, "tracing overhead, ids")
        trace_overhead(tok, args, text_params, 5, "tracing overhead, text")
        return
    throughput(None, args, ids_params, None, "ids + finish + logprobs")
    throughput(tok, args, text_params, 5, "+ detokenize, 2 stop strings, top-5")
    if not args.skip_scaling:
        length_scaling(None, args, ids_params, None, "ids")
        length_scaling(tok, args, text_params, 5, "text")


if __name__ == "__main__":
    main()
