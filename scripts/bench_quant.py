"""Quantized GGUF weights (`weights: quantized`) against the float32-dequantized forward on
SmolLM2-135M-Instruct: speed, memory and quality.

    .venv/bin/python scripts/bench_quant.py speed [--threads 1] [--reps 5]
    .venv/bin/python scripts/bench_quant.py memory
    .venv/bin/python scripts/bench_quant.py quality [--tokens 128] [--llama-server URL]

speed: per variant (float32 weights; 4-bit weights with float32 activations, with and without
the batch-invariant attention path, or bfloat16 activations), the
ms of a decode step at batch 1 and 8, of a 5-token verify run at batch 1, and of a 64-token
prefill chunk; the variants interleaved `--reps` times, median and spread (min-max).
memory: each variant loaded in a fresh process: VmRSS and RssAnon (the process's own pages,
without shared libraries) after one forward, and the KV pool's bytes.
quality: greedy 128-token continuations of PROMPTS by the float32 reference; each variant then
reads the same tokens (teacher forcing) and is scored per position: top-1 agreement with the
reference and KL(reference || variant). With --llama-server (a running llama-server on the
same GGUF) llama.cpp's top-1 agreement on the same positions is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import urllib.request

import torch

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `scripts`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.models.runner import ModelRunner
from pipeline.models.runners import load_runner
from scripts.harness import interleaved, median_time

# name: (weights, dtype, attention_invariant); "int4/f32" runs the shipped batch-invariant path
VARIANTS = {"float32": ("float", "float32", "auto"), "int4/f32": ("quantized", "float32", "auto"),
            "int4/f32 inv-off": ("quantized", "float32", "off"),
            "int4/bf16": ("quantized", "bfloat16", "auto")}
PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain why the sky is blue to a ten-year-old.",
    "List five fruits and one fact about each.",
    "Summarize the plot of Romeo and Juliet.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Give three tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
]


def runner_for(variant: str, num_slots: int = 8, max_len: int = 1024) -> ModelRunner:
    weights, dtype, invariant = VARIANTS[variant]
    return load_runner("smollm2", weights=weights, dtype=dtype, num_slots=num_slots,
                       max_len=max_len, attention_invariant=invariant)


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False).input_ids


# --- quality ---------------------------------------------------------------------------------

def greedy(runner: ModelRunner, prompt: list[int], tokens: int) -> list[int]:
    slot = runner.allocate()
    out: list[int] = []
    logits = runner.forward([slot], [prompt], last_only=True)[0]
    for _ in range(tokens):
        out.append(int(logits[-1].argmax()))
        logits = runner.forward([slot], [[out[-1]]])[0]
    runner.free(slot)
    return out


def position_logits(runner: ModelRunner, prompt: list[int], continuation: list[int]
                    ) -> torch.Tensor:
    """Teacher-forced logits [len(continuation), vocab]: row i predicts continuation[i]."""
    slot = runner.allocate()
    logits = runner.forward([slot], [prompt + continuation[:-1]])[0]
    runner.free(slot)
    return logits[len(prompt) - 1:]


def agreement(reference: ModelRunner, other: ModelRunner, prompts: list[list[int]],
              tokens: int) -> dict[str, float]:
    """Top-1 agreement and mean KL(reference || other) over the reference's greedy positions."""
    agree = kl = count = 0.0
    for prompt in prompts:
        cont = greedy(reference, prompt, tokens)
        ref = position_logits(reference, prompt, cont).log_softmax(-1)
        got = position_logits(other, prompt, cont).log_softmax(-1)
        agree += float((ref.argmax(-1) == got.argmax(-1)).sum())
        kl += float((ref.exp() * (ref - got)).sum())
        count += len(cont)
    return {"top1_agreement": agree / count, "mean_kl": kl / count, "positions": count}


def llama_server_agreement(url: str, reference: ModelRunner, prompts: list[list[int]],
                           tokens: int) -> float:
    """llama-server's greedy next token at each reference position (its prompt cache makes
    each request one token of work)."""
    agree = count = 0
    for prompt in prompts:
        cont = greedy(reference, prompt, tokens)
        for i, want in enumerate(cont):
            body = json.dumps({"prompt": prompt + cont[:i], "n_predict": 1, "temperature": 0,
                               "cache_prompt": True, "return_tokens": True}).encode()
            req = urllib.request.Request(url.rstrip("/") + "/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                got = json.load(resp)["tokens"][0]
            agree += int(got == want)
            count += 1
    return agree / count


# --- speed -----------------------------------------------------------------------------------

def step_ms(runner: ModelRunner, prompt: list[int], batch: int, run: int, reps: int = 5
            ) -> float:
    """Median ms of one forward appending `run` tokens to each of `batch` sequences."""
    slots = [runner.allocate() for _ in range(batch)]
    runner.forward(slots, [prompt] * batch, last_only=True)
    base = runner.length(slots[0])

    def roll_back() -> None:
        for s in slots:
            runner.truncate(s, base)

    ms = median_time(lambda: runner.forward(slots, [[5] * run] * batch), reps, warmup=1,
                     reset=roll_back) * 1e3
    for s in slots:
        runner.free(s)
    return ms


CELLS = {"decode b1": (1, 1), "decode b8": (8, 1), "verify 5 b1": (1, 5), "prefill 64": (1, 64)}


def speed(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    runners = {v: runner_for(v) for v in VARIANTS}
    prompt = chat_ids(runners["float32"].tokenizer, PROMPTS[0])
    runs = interleaved(list(VARIANTS), args.reps, lambda v, _rep: {
        cell: step_ms(runners[v], prompt, batch, run) for cell, (batch, run) in CELLS.items()})
    results = {v: {c: [r[c] for r in rs] for c in CELLS} for v, rs in runs.items()}
    print(f"threads={args.threads} reps={args.reps} (ms, median [min-max])")
    for v in VARIANTS:
        print(f"{v:10s} " + "  ".join(
            f"{c}: {statistics.median(x):6.1f} [{min(x):.1f}-{max(x):.1f}]"
            for c, x in results[v].items()))


def memory(args: argparse.Namespace) -> None:
    for v in VARIANTS:
        code = (f"import importlib.util as u; s = u.spec_from_file_location('b', {__file__!r}); "
                f"m = u.module_from_spec(s); s.loader.exec_module(m); m.report_memory({v!r})")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
        print(out.strip())


def report_memory(variant: str) -> None:
    torch.set_num_threads(1)
    runner = runner_for(variant, num_slots=8, max_len=2048)
    runner.forward([runner.allocate()], [list(range(10, 74))])
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    kv = sum(t.numel() * t.element_size() for t in list(runner.cache.k) + list(runner.cache.v))
    print(f"{variant:10s} VmRSS {status['VmRSS'].strip():>12s}  RssAnon "
          f"{status['RssAnon'].strip():>12s}  KV pool {kv / 2**20:.0f} MiB")


def quality(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    reference = runner_for("float32", num_slots=1)
    prompts = [chat_ids(reference.tokenizer, p) for p in PROMPTS[:args.prompts]]
    for v in VARIANTS:
        if v != "float32":
            r = agreement(reference, runner_for(v, num_slots=1), prompts, args.tokens)
            print(f"{v:10s} top-1 agreement {r['top1_agreement']:.4f}  mean KL "
                  f"{r['mean_kl']:.5f}  over {int(r['positions'])} positions", flush=True)
    if args.llama_server:
        got = llama_server_agreement(args.llama_server, reference, prompts, args.tokens)
        print(f"llama.cpp  top-1 agreement {got:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["speed", "memory", "quality"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--llama-server", default=None, help="e.g. http://127.0.0.1:8080")
    args = ap.parse_args()
    {"speed": speed, "memory": memory, "quality": quality}[args.what](args)


if __name__ == "__main__":
    main()
