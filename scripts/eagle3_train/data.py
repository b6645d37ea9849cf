"""The training data: the target's greedy generations over chat prompts, with the aux hidden
states (the residual stream entering each aux layer, concatenated in layer order) captured by
forward pre-hooks on the target's layers while it generates. A record per prompt."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.models.runner import ModelRunner


@dataclass
class Record:
    """`tokens`: prompt + generation; `aux[i]`: position i's aux states (the last token is
    never fed, so len(aux) == len(tokens) - 1), float16."""

    tokens: torch.Tensor
    prompt_len: int
    aux: torch.Tensor


class AuxCapture:
    """Pre-hooks on the aux layers: after a forward, `rows()` holds its inputs' aux states."""

    def __init__(self, model: torch.nn.Module, layer_ids: list[int]) -> None:
        self.layer_ids = sorted(layer_ids)
        self._seen: dict[int, torch.Tensor] = {}
        self._handles = [model.layers[i].register_forward_pre_hook(self._hook(i))
                         for i in self.layer_ids]

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            self._seen[i] = args[0].to(torch.float16)
        return hook

    def rows(self) -> torch.Tensor:
        return torch.cat([self._seen[i] for i in self.layer_ids], dim=-1)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def encode_chat(tokenizer: Any, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def generate_batch(runner: ModelRunner, capture: AuxCapture, prompts: list[list[int]],
                   max_new: int, eos: set[int]) -> list[Record]:
    """Greedy, all prompts at once in their own slots; a sequence stops at EOS or `max_new`."""
    slots = [runner.allocate() for _ in prompts]
    try:
        seqs = [list(p) for p in prompts]
        aux: list[list[torch.Tensor]] = [[] for _ in prompts]
        runs = [list(p) for p in prompts]
        active = list(range(len(prompts)))
        while active:
            logits = runner.forward([slots[i] for i in active], [runs[i] for i in active],
                                    last_only=True)
            rows = capture.rows().split([len(runs[i]) for i in active])
            still = []
            for i, row, lg in zip(active, rows, logits):
                aux[i].append(row)
                token = int(lg[-1].argmax())
                seqs[i].append(token)
                runs[i] = [token]
                if token not in eos and len(seqs[i]) - len(prompts[i]) < max_new:
                    still.append(i)
            active = still
        return [Record(torch.tensor(s), len(p), torch.cat(a))
                for s, p, a in zip(seqs, prompts, aux)]
    finally:
        for s in slots:
            runner.free(s)


def generate(runner: ModelRunner, layer_ids: list[int], prompts: list[list[int]],
             max_new: int, batch: int, progress: Any = None) -> list[Record]:
    eos = set(runner.config.eos_token_ids)
    capture = AuxCapture(runner.model, layer_ids)
    out: list[Record] = []
    try:
        for start in range(0, len(prompts), batch):
            out += generate_batch(runner, capture, prompts[start:start + batch], max_new, eos)
            if progress is not None:
                progress(len(out), sum(len(r.tokens) for r in out))
    finally:
        capture.close()
    return out


def save_records(path: str, records: list[Record], meta: dict[str, Any]) -> None:
    torch.save({"meta": meta, "records": [r.__dict__ for r in records]}, path)


def load_records(path: str) -> tuple[list[Record], dict[str, Any]]:
    blob = torch.load(path, weights_only=True)
    return [Record(**r) for r in blob["records"]], blob["meta"]


def token_counts(records: list[Record]) -> dict[str, int]:
    prompt = sum(r.prompt_len for r in records)
    total = sum(len(r.tokens) for r in records)
    return {"sequences": len(records), "prompt_tokens": prompt, "generated_tokens": total - prompt}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return fn(), time.perf_counter() - t0
