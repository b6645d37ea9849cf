"""Benchmark the model layer on SmolLM2-135M (CPU): decode tokens/s at several batch sizes,
the cost of a k+1 verify run relative to a 1-token decode, and HF `generate` on the same
weights and prompt for comparison.

    .venv/bin/python scripts/bench_model.py [--steps 16] [--batches 1 8 32] [--dtypes float32 bfloat16]

"generate" rates count batch * steps tokens over the whole call, prefill included, for
ours (one prefill forward + steps - 1 decode forwards, greedy) and HF `generate` alike;
"decode" is ours without the prefill. The same chat prompt is repeated `batch` times (no
padding needed). Each figure is the best of --reps runs, ours and HF alternated.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `scripts`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.model_files import smollm2_path
from pipeline.models.loader import load_model
from pipeline.models.runner import ModelRunner
from pipeline.tokenizer import load_tokenizer
from scripts.harness import stopwatch

PROMPT = "What is the capital of France? Answer in one sentence."


def bench_generate(runner: ModelRunner, prompt: list[int], batch: int,
                   steps: int) -> tuple[float, float]:
    """Greedy generation of `steps` tokens for `batch` copies of `prompt`, as HF `generate`
    does it: one prefill forward, then steps - 1 single-token forwards.
    Returns (end-to-end tok/s including the prefill, decode-only tok/s)."""
    slots = [runner.allocate() for _ in range(batch)]
    t0 = time.perf_counter()
    last = runner.forward(slots, [prompt] * batch, last_only=True)
    tokens = [int(lg[-1].argmax()) for lg in last]
    t1 = time.perf_counter()
    for _ in range(steps - 1):
        logits = runner.forward(slots, [[t] for t in tokens])
        tokens = [int(lg[-1].argmax()) for lg in logits]
    t2 = time.perf_counter()
    for s in slots:
        runner.free(s)
    return batch * steps / (t2 - t0), batch * (steps - 1) / (t2 - t1)


def bench_verify_ratio(runner: ModelRunner, prompt: list[int], batch: int, k: int,
                       reps: int) -> tuple[float, float]:
    """Seconds per forward of (k+1)-token runs and of 1-token runs at the same cache
    lengths (rolled back after each), alternated so machine noise hits both alike."""
    slots = [runner.allocate() for _ in range(batch)]
    runner.forward(slots, [prompt] * batch, last_only=True)
    base = runner.length(slots[0])
    totals = {1: 0.0, k + 1: 0.0}
    for rep in range(reps + 1):
        for n in totals:
            t0 = time.perf_counter()
            runner.forward(slots, [[5] * n] * batch)
            if rep:  # the first round is a warm-up
                totals[n] += time.perf_counter() - t0
            for s in slots:
                runner.truncate(s, base)
    for s in slots:
        runner.free(s)
    return totals[k + 1] / reps, totals[1] / reps


def bench_hf(hf_model: torch.nn.Module, prompt: list[int], batch: int, steps: int) -> float:
    """End-to-end tok/s of HF greedy `generate` (prefill included), exactly `steps` tokens."""
    ids = torch.tensor([prompt] * batch)
    with stopwatch() as took, torch.inference_mode():
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                          min_new_tokens=steps, do_sample=False, pad_token_id=2)
    return batch * steps / took.wall_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=smollm2_path())
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False).input_ids
    print(f"model={os.path.basename(args.model)} prompt_tokens={len(prompt)} "
          f"steps={args.steps} threads={torch.get_num_threads()}")
    max_len = len(prompt) + args.steps + args.k + 8
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        loaded = load_model(args.model, dtype, load_tokenizer=False)
        runner = ModelRunner(loaded.model, loaded.config, num_slots=max(args.batches),
                             max_len=max_len, dtype=dtype)
        hf = None
        if not args.no_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(args.model), gguf_file=os.path.basename(args.model),
                dtype=dtype).eval()
        bench_generate(runner, prompt, 1, 4)  # warm-ups
        if hf is not None:
            bench_hf(hf, prompt, 1, 4)
        for b in args.batches:
            # Alternate ours and HF, keep each one's best: the machine may be shared and noisy.
            e2e = dec = theirs = 0.0
            for _ in range(args.reps):
                e, d = bench_generate(runner, prompt, b, args.steps)
                e2e, dec = max(e2e, e), max(dec, d)
                if hf is not None:
                    theirs = max(theirs, bench_hf(hf, prompt, b, args.steps))
            hf_text = f"  | HF generate {theirs:7.1f} tok/s  ours/HF x{e2e / theirs:.2f}" \
                if hf is not None else ""
            print(f"[{dtype_name:8s}] batch {b:3d}: ours decode {dec:7.1f} tok/s, "
                  f"generate {e2e:7.1f} tok/s{hf_text}", flush=True)
        for b in (1, 8):
            if b <= max(args.batches):
                tv, t1 = bench_verify_ratio(runner, prompt, b, args.k, reps=10)
                print(f"[{dtype_name:8s}] batch {b:3d}: verify run of {args.k + 1} tokens "
                      f"{tv * 1e3:6.1f} ms vs 1-token decode {t1 * 1e3:6.1f} ms -> "
                      f"x{tv / t1:.2f}", flush=True)
        del runner, loaded, hf


if __name__ == "__main__":
    main()
