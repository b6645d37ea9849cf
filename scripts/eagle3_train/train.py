"""The training loop: AdamW, warmup then cosine, length-bucketed batches, a checkpoint (head
without the shared embedding, optimizer, position in the data) every `save_every` steps and at
the end, so a run stopped anywhere resumes where it was."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.draft.eagle3.head import Eagle3Head
from scripts.eagle3_train.data import Record
from scripts.eagle3_train.unroll import (
    collate,
    draft_index,
    new_head,
    pick_draft_vocab,
    step_losses,
)


@dataclass
class TrainConfig:
    epochs: int = 10
    batch: int = 8
    ttt_steps: int = 3          # the training-time-test unroll (1: no chained drafts trained)
    lr: float = 1e-3
    warmup: int = 30
    draft_vocab: int = 8192
    save_every: int = 25
    max_minutes: float = 1e9    # stop (and save) after this long; a rerun resumes
    seed: int = 0
    step_decay: float = 0.8     # step s's loss weight: decay ** s


def batches(records: list[Record], size: int, epoch: int, seed: int) -> list[list[int]]:
    """An epoch's batches: shuffled, then sorted by length within windows of 8 batches (less
    padding), the batches shuffled again. Deterministic per (seed, epoch), so resume can skip."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = torch.randperm(len(records), generator=g).tolist()
    window = size * 8
    out = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: len(records[i].tokens))
        out += [chunk[i:i + size] for i in range(0, len(chunk), size)]
    return [out[i] for i in torch.randperm(len(out), generator=g).tolist()]


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def save(path: str, head: Eagle3Head, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    weights = {k: v for k, v in head.state_dict().items() if k != "embed.weight"}
    tmp = path + ".tmp"
    torch.save({"head": weights, "opt": opt.state_dict(), **state}, tmp)
    os.replace(tmp, path)  # a kill mid-save keeps the previous checkpoint


def build_head(target: torch.nn.Module, layer_ids: list[int], draft_ids: torch.Tensor
               ) -> Eagle3Head:
    lm = target.lm_head.weight if target.lm_head is not None else target.embed.weight
    return new_head(target.config, layer_ids, draft_ids, target.embed.weight, lm,
                    target.norm.weight)


def load_checkpoint(target: torch.nn.Module, layer_ids: list[int], ckpt: str) -> Eagle3Head:
    """The head a checkpoint holds, e.g. to export a run stopped early."""
    blob = torch.load(ckpt, weights_only=True)
    head = build_head(target, layer_ids, blob["draft_ids"])
    head.load_state_dict({**blob["head"], "embed.weight": head.embed.weight})
    return head.eval()


def train(target: torch.nn.Module, layer_ids: list[int], records: list[Record], ckpt: str,
          cfg: TrainConfig, bar: Callable[[int, int], Callable[[int, str], None]] | None = None
          ) -> tuple[Eagle3Head, dict[str, Any]]:
    """`target`: the target LlamaModel (its embedding is shared, lm_head/norm seed the head's).
    Returns the head and the run's state (step, tokens, seconds, last losses)."""
    torch.manual_seed(cfg.seed)
    blob = torch.load(ckpt, weights_only=True) if os.path.exists(ckpt) else None
    draft_ids = blob["draft_ids"] if blob else pick_draft_vocab(
        records, cfg.draft_vocab, target.config.vocab_size, target.config.eos_token_ids)
    head = build_head(target, layer_ids, draft_ids)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    state: dict[str, Any] = {"step": 0, "tokens": 0, "seconds": 0.0, "draft_ids": draft_ids}
    if blob:
        head.load_state_dict({**blob["head"], "embed.weight": head.embed.weight})
        opt.load_state_dict(blob["opt"])
        state.update({k: blob[k] for k in ("step", "tokens", "seconds")})
    per_epoch = len(batches(records, cfg.batch, 0, cfg.seed))
    total = cfg.epochs * per_epoch
    to_draft = draft_index(head)
    update = bar(total, state["step"]) if bar else None
    started, last = time.perf_counter(), state["seconds"]
    head.train()
    while state["step"] < total:
        epoch, i = divmod(state["step"], per_epoch)
        batch = collate([records[j] for j in batches(records, cfg.batch, epoch, cfg.seed)[i]],
                        cfg.ttt_steps)
        for g in opt.param_groups:
            g["lr"] = lr_at(state["step"], total, cfg)
        losses, accs = step_losses(head, batch, cfg.ttt_steps, to_draft)
        loss = sum(cfg.step_decay ** s * x for s, x in enumerate(losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] += 1
        state["tokens"] += int(batch.label_ok[0].sum())
        state["seconds"] = last + time.perf_counter() - started
        state["acc"] = [round(a, 3) for a in accs]
        if update:
            update(state["step"], f"loss {float(loss.detach()):.2f} acc {state['acc']} "
                                  f"{state['tokens']} tok")
        out_of_time = state["seconds"] - last > cfg.max_minutes * 60
        if state["step"] % cfg.save_every == 0 or state["step"] == total or out_of_time:
            save(ckpt, head, opt, {k: v for k, v in state.items() if k != "acc"})
        if out_of_time:
            break
    return head.eval(), state
