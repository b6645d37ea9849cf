"""The Python half of scripts/gpu_check.sh: flash vs SDPA parity, and decode tok/s.

    python scripts/gpu_check.py parity --device cuda --out DIR   # exit 1 on a parity failure
    python scripts/gpu_check.py bench --device cuda --out DIR    # SmolLM2 engine vs HF generate
    python scripts/gpu_check.py bench --device cpu --smoke       # tiny sizes: the code paths only

Parity runs our attention (`pipeline.models.attention`) in bfloat16 with the flash backend
(vllm-flash-attn on CUDA) against SDPA in float32 over the same values, on one batch mixing a
prefill, decodes and verify runs at shuffled slots, then a tiny model's logits through
ModelRunner. Bench times greedy decode of copy-heavy prompts (scripts/workloads/copy.jsonl) at
batch 1/8/32 for target-only and n-gram drafting through the in-process engine, and Hugging Face
`generate` on the same weights, device and dtype. Results go to DIR/<what>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.config import load_config, resolve_source
from pipeline.engine.local import build_local_engine, collect
from pipeline.models.attention import attend, build_metadata, write_kv
from pipeline.models.runner import ModelRunner
from pipeline.models.runners import build_runner
from pipeline.models.tiny import tiny_config, tiny_model
from pipeline.params import SamplingParams

PARITY_TOL = 2e-2   # bf16 output rounding over O(1) values
LOGIT_TOL = 0.3     # tiny model, bf16 end to end vs fp32 SDPA (|logits| ~ 10)
AGREEMENT = 0.95    # greedy tokens, bf16 vs fp32: a near-tie may flip (about 1 in 65 on CPU)


# --- parity ----------------------------------------------------------------------------------
def attention_parity(device: str, heads: int, kv_heads: int, head_dim: int,
                     seed: int = 0) -> float:
    """Max |flash(bf16) - sdpa(fp32)| over one mixed batch through multi-block tables (16-token
    blocks, out of order, two runs sharing a first block)."""
    gen = torch.Generator().manual_seed(seed)
    block, scale = 16, head_dim ** -0.5
    shape = (20, block, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16().to(device)
    v_cache = torch.randn(shape, generator=gen).bfloat16().to(device)
    tables = [[4, 11, 2], [6, 1, 9, 13], [6, 3], [0, 7, 5, 8], [10, 12]]
    starts, q_lens = [0, 40, 17, 63, 9], [23, 1, 5, 1, 5]
    n = sum(q_lens)
    q = torch.randn(n, heads, head_dim, generator=gen).bfloat16().to(device)
    k_new = torch.randn(n, kv_heads, head_dim, generator=gen).bfloat16().to(device)
    v_new = torch.randn(n, kv_heads, head_dim, generator=gen).bfloat16().to(device)
    flash = build_metadata("flash", tables, starts, q_lens, block, device)
    sdpa = build_metadata("sdpa", tables, starts, q_lens, block, device)
    write_kv(k_cache, v_cache, k_new, v_new, flash)
    got = attend(q, k_cache, v_cache, flash, scale)
    ref = attend(q.float(), k_cache.float(), v_cache.float(), sdpa, scale)
    return float((got.float() - ref).abs().max())


def runner_parity(device: str) -> dict[str, float]:
    """Tiny model: prefill, verify and decode runs through ModelRunner, flash bf16 vs SDPA fp32."""
    config = tiny_config()
    flash = ModelRunner(tiny_model(config, 1), config, 4, 64, device=device,
                        dtype=torch.bfloat16, backend="flash")
    sdpa = ModelRunner(tiny_model(config, 1), config, 4, 64, device=device, backend="sdpa")
    for r in (flash, sdpa):
        for _ in range(4):
            r.allocate()
    steps = [([2, 0, 3], [list(range(10, 40)), [7, 8, 9], [1]]),
             ([3, 2, 0], [[5, 6, 7, 8, 9], [4], [11, 12]]),
             ([0, 1, 2, 3], [[3], list(range(50, 70)), [6], [7]])]
    worst, agree, total = 0.0, 0, 0
    for slots, runs in steps:
        for g, r in zip(flash.forward(slots, runs), sdpa.forward(slots, runs)):
            worst = max(worst, float((g - r).abs().max()))
            agree += int((g.argmax(-1) == r.argmax(-1)).sum())
            total += g.shape[0]
    return {"max_logit_diff": worst, "greedy_agreement": agree / total}


def parity(device: str) -> dict[str, Any]:
    shapes = {"smollm2_9x3x64": (9, 3, 64), "llama8b_32x8x128": (32, 8, 128),
              "mha_4x4x16": (4, 4, 16)}
    res: dict[str, Any] = {"attention": {k: attention_parity(device, *v)
                                         for k, v in shapes.items()}}
    res["runner"] = runner_parity(device)
    res["ok"] = (all(v < PARITY_TOL for v in res["attention"].values())
                 and res["runner"]["max_logit_diff"] < LOGIT_TOL
                 and res["runner"]["greedy_agreement"] >= AGREEMENT)
    return res


# --- bench -----------------------------------------------------------------------------------
def copy_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in
            (REPO / "scripts" / "workloads" / "copy.jsonl").read_text().splitlines() if line]
    texts = [rows[i % len(rows)]["prompt"] for i in range(n)]
    # Template to text, then encode: tokenize=True returns a dict in transformers 5, ids in 4.
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                           add_generation_prompt=True, tokenize=False)
             for t in texts]
    return [list(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in chats]


def engine_run(config: Any, runner: Any, prompts: list[list[int]],
               max_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds, greedy ids per prompt) for one wave through the in-process engine."""
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    core = build_local_engine(config, runner)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    done = asyncio.run(collect(core, reqs))
    return time.perf_counter() - t0, [done[f"r{i}"].token_ids for i in range(len(prompts))]


def load_hf(path: str, device: str, dtype: torch.dtype) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    # transformers 5 renamed torch_dtype to dtype; the gpu extra pins transformers 4.
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), **{key: dtype})
    return model.to(device).eval()


def hf_run(model: Any, prompts: list[list[int]], max_tokens: int, pad: int) -> float:
    """Seconds for one batched greedy `generate` of exactly max_tokens tokens (left padding)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    dev = model.device
    _sync(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    _sync(dev)
    return time.perf_counter() - t0


def _sync(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench(device: str, batches: list[int], max_tokens: int) -> dict[str, Any]:
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    base = {"device": device, "dtype": dtype, "attention_backend": "auto",
            "num_slots": max(batches), "max_model_len": 1024, "torch_threads": None}
    configs = {mode: load_config(str(REPO / "configs" / "smollm2-cpu.yaml"),
                                 {**base, "draft": mode}) for mode in ("none", "ngram")}
    runner = build_runner(configs["none"], "target")
    hf = load_hf(resolve_source("smollm2"), device, getattr(torch, dtype))
    pad = runner.tokenizer.eos_token_id
    out: dict[str, Any] = {"device": device, "dtype": dtype, "backend": runner.backend,
                           "max_tokens": max_tokens, "torch": torch.__version__, "runs": []}
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(device)
    warm = copy_prompts(runner.tokenizer, 1)
    engine_run(configs["none"], runner, warm, 4)  # first CUDA kernels, allocator
    hf_run(hf, warm, 4, pad)
    for batch in batches:
        prompts = copy_prompts(runner.tokenizer, batch)
        row: dict[str, Any] = {"batch": batch}
        ids = {}
        for mode, config in configs.items():
            secs, ids[mode] = engine_run(config, runner, prompts, max_tokens)
            row[f"{'target_only' if mode == 'none' else mode}_tok_s"] = batch * max_tokens / secs
        row["hf_generate_tok_s"] = batch * max_tokens / hf_run(hf, prompts, max_tokens, pad)
        # Greedy n-gram must equal target-only; bf16 batch-shape rounding can flip a near-tie.
        row["ngram_equals_target_only"] = sum(a == b for a, b in zip(ids["none"], ids["ngram"]))
        out["runs"].append(row)
        print(json.dumps(row), flush=True)
    return out


# --- cli ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("parity", "bench"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: check the code runs")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out")
    args = ap.parse_args(argv)
    if args.what == "parity":
        result = parity(args.device)
    else:
        batches, tokens = ([1, 2], 4) if args.smoke else ([1, 8, 32], 128)
        result = bench(args.device, batches, tokens)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"{args.what}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.what}: {json.dumps(result)}\nwrote {path}")
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
