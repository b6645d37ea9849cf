"""Benchmark the output path (pipeline.output.OutputProcessor) on 256 requests x 5-token windows.

    .venv/bin/python scripts/bench_output.py [--requests 256] [--window 5] [--skip-scaling] [--trace]
    .venv/bin/python scripts/bench_output.py --trace-overhead [--trace-ratio 0.1]

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
CPython's settings, for comparison.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pipeline.gc_tuning import tune_gc
from pipeline.model_files import smollm2_path
from pipeline.output.processor import OutputProcessor
from pipeline.params import SamplingParams
from pipeline.protocol import StepColumns, encode_columns
from pipeline.tokenizer import load_tokenizer

STOPS = ["Observation:", "<|END|>"]
EOS = [2]
LENGTHS = (100, 10_000, 100_000)


def make_processor(tokenizer, args: argparse.Namespace):
    """The processor under test (wrap it here, e.g. in a TracedOutputProcessor, for --trace)."""
    if not args.trace:
        return OutputProcessor(tokenizer, EOS)
    # --trace: spans at the given sampling ratio through a BatchSpanProcessor into an exporter that
    # drops them, so this measures recording, not export. Lazy: without --trace the measured
    # process has no opentelemetry loaded, as an untraced output actor would not.
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from pipeline.output.spans import TracedOutputProcessor
    from pipeline.tracing.otel import make_provider, resolve_config

    class Discard(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    cfg = resolve_config("bench", {"sample_ratio": args.trace_ratio}, environ={})
    tracer = make_provider(cfg, Discard()).get_tracer("specrelay")
    return TracedOutputProcessor(OutputProcessor(tokenizer, EOS), tracer)


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


def payloads(
    rids: list[str],
    pool: np.ndarray,
    window: int,
    steps: int,
    step0: int,
    top_n: int | None,
    rng: np.random.Generator,
) -> list[bytes]:
    """`steps` encoded verify steps: every request gets `window` tokens (window - 1 drafts)."""
    b = len(rids)
    out = []
    for s in range(steps):
        n = b * window
        top_ids = top_lps = tn = None
        if top_n is not None:
            tn = np.full(b, top_n, dtype=np.int64)
            top_ids = rng.integers(0, 49_152, size=n * top_n)
            top_lps = -rng.random(n * top_n)
        cols = StepColumns(
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
        )
        out.append(encode_columns(cols))
    return out


def setup(tokenizer, args, params: SamplingParams, prefix: str):
    proc = make_processor(tokenizer, args)
    rids = [f"{prefix}-{i}" for i in range(args.requests)]
    for rid in rids:
        proc.add_request(rid, [1, 2, 3], params)
    return proc, rids


def catch_up(proc, rids, pool, length: int, window: int, top_n, rng) -> int:
    """Grow every request's output to `length` tokens with the benchmark's own window shape (so the
    state, e.g. the acceptance histogram, is what a real request of that length has); cycles a few
    pre-encoded payloads. Returns the next step id."""
    cycle = payloads(rids, pool, window, 16, 0, top_n, rng)
    for s in range(length // window):
        proc.process(cycle[s % len(cycle)])
    return length // window


def time_block(proc, block: list[bytes]) -> tuple[float, float]:
    """Seconds per step: (wall, CPU)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for p in block:
        proc.process(p)
    return (time.perf_counter() - t0) / len(block), (time.process_time() - c0) / len(block)


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


def trace_overhead(tokenizer, args, params, top_n, label: str) -> float:
    """Paired: an untraced and a traced processor in one process, blocks alternating (so machine
    noise hits both alike); returns the traced / untraced per-step CPU time."""
    rng = np.random.default_rng(0)
    pool = text_token_pool(tokenizer, rng)
    procs = []
    for trace in (False, True):
        proc, rids = setup(tokenizer, argparse.Namespace(**{**vars(args), "trace": trace}),
                           params, f"{label}-{trace}")
        proc.process(payloads(rids, pool, 1, 1, 0, top_n, rng)[0])
        procs.append((proc, rids))
    samples: list[list[tuple[float, float]]] = [[], []]
    for r in range(2 * args.repeats):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for k in order:
            proc, rids = procs[k]
            block = payloads(rids, pool, args.window, args.steps, 1 + r * args.steps, top_n, rng)
            samples[k].append(time_block(proc, block))
    (w0, c0), (w1, c1) = median_times(samples[0]), median_times(samples[1])
    print(f"{label}: untraced {w0 * 1e3:.3f} ms/step, traced (ratio {args.trace_ratio}) "
          f"{w1 * 1e3:.3f} ms/step: {100 * (w1 / w0 - 1):+.1f}% wall, "
          f"{100 * (c1 / c0 - 1):+.1f}% CPU")
    return c1 / c0


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
    ap.add_argument("--trace-overhead", action="store_true",
                    help="only the paired traced-vs-untraced comparison (at --trace-ratio)")
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
    print(f"{args.requests} requests x {args.window}-token windows, GC {args.gc}")
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
