"""The outside baseline: Hugging Face `generate` on the same weights, plain and with prompt
lookup, one request at a time."""

from __future__ import annotations

import os
from typing import Any

import torch

from scripts.engine_bench.results import Segment
from scripts.engine_bench.traces import Trace
from scripts.engine_bench.workloads import Request
from scripts.harness import stopwatch


def hf_wave(hf: Any, mode: str, wave: list[Request], max_tokens: int, k: int, max_ngram: int,
            eos: list[int]) -> Segment:
    """HF `generate`, batch 1: plain (`hf`) or with prompt lookup (`hf-pld`: k drafts, matching
    n-grams up to `max_ngram` long, as our n-gram drafter)."""
    extra = ({"prompt_lookup_num_tokens": k, "max_matching_ngram_size": max_ngram}
             if mode == "hf-pld" else {})
    traces = []
    with stopwatch() as took:
        for r in wave:
            ids = torch.tensor([r.ids])
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=max_tokens, do_sample=False,
                                  pad_token_id=eos[0], eos_token_id=eos, **extra)
            traces.append(Trace(r.rid, took.start, [], [], out[0, len(r.ids):].tolist()))
    return Segment(traces, took.wall_s, took.cpu_s)


def load_hf(model_path: str) -> Any:
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
            dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
