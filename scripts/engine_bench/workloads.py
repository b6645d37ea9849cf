"""The prompts a benchmark serves: scripts/workloads/*.jsonl, encoded as the engine sees them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from scripts.harness import ROOT

WORKLOAD_DIR = os.path.join(ROOT, "scripts", "workloads")


@dataclass
class Prompt:
    id: str
    kind: str
    text: str


@dataclass
class Request:
    rid: str
    ids: list[int]


def load_workload(name: str) -> list[Prompt]:
    """`name` is a file in scripts/workloads (without .jsonl) or a path to a .jsonl file."""
    path = name if name.endswith(".jsonl") else os.path.join(WORKLOAD_DIR, f"{name}.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(r["id"], r.get("kind", "chat"), r["prompt"]) for r in rows]


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Chat-templated ids when the tokenizer has a template, plain bytes otherwise (tiny)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def warmup_requests(tokenizer: Any) -> list[Request]:
    """Two requests every mode serves untimed before the first cell: one that copies, one that
    does not. Made from text in no workload, so no index holds a timed request's answer."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = " ".join(f.read().split())[:800]
    asks = (f"Repeat the following text exactly, word for word:\n\n{text}",
            "Write a short story about a lighthouse keeper who finds a message in a bottle.")
    return [Request(f"warmup-{i}", encode_prompt(tokenizer, a)) for i, a in enumerate(asks)]


def interleaved_parts(load: list[Request], batch: int) -> list[list[Request]]:
    """A repetition's requests in the parts the modes take turns on. At batch 1 each request is
    its own turn: the requests run one after another anyway, and this VM's speed drifts within
    a wave (copy b1: adaptive and k8 made the same decisions and ran 0.88-1.36 apart per
    4-request repetition), so modes a request apart are better paired than modes a wave apart. A
    batch b > 1 closed loop cannot be cut without changing what it measures: one turn."""
    return [[r] for r in load] if batch == 1 else [load]
