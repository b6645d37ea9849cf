"""Train an EAGLE-3 head for a target (default: the embedded SmolLM2-135M) on this machine's CPU,
by self-distillation from the target's own greedy generations (docs/eagle3.md, "Training").

    python scripts/train_eagle3.py data  --work W   # generate, capture aux states
    python scripts/train_eagle3.py train --work W --out HEAD_DIR
                                                    # train (resumes from W/ckpt.pt), export
    python scripts/train_eagle3.py export --work W --out DIR   # a stopped run's checkpoint
    python scripts/train_eagle3.py eval --work W --head HEAD_DIR
                                                    # acceptance on held-out prompts vs n-gram

Nothing is downloaded: the prompts are written in scripts/eagle3_train/prompts.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.draft.eagle3 import default_aux_layers, load_eagle3_head
from pipeline.models.runner import ModelRunner
from pipeline.models.runners import load_runner
from pipeline.models.tiny import tiny_config
from scripts.eagle3_train import data as D
from scripts.eagle3_train.evaluate import eagle_acceptance, ngram_acceptance
from scripts.eagle3_train.export import export_head
from scripts.eagle3_train.prompts import split_prompts
from scripts.eagle3_train.train import TrainConfig, load_checkpoint, train

UNSEEN = os.path.join("scripts", "workloads", "chat.jsonl")


def load_target(model: str, slots: int = 16) -> ModelRunner:
    """"smollm2", or "tiny" (8 random layers, so the default aux layers exist; for tests)."""
    if model == "tiny":
        return load_runner(tiny_config(num_layers=8), num_slots=slots, max_len=1024, seed=0)
    return load_runner(model, num_slots=slots, max_len=1024)


def encode(runner: ModelRunner, text: str) -> list[int]:
    if runner.tokenizer is not None and getattr(runner.tokenizer, "chat_template", None):
        return D.encode_chat(runner.tokenizer, text)
    return [3 + b % (runner.config.vocab_size - 3) for b in text.encode()]  # tiny: bytes


def unseen_prompts() -> list[str]:
    with open(UNSEEN) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def cmd_data(a: argparse.Namespace) -> None:
    os.makedirs(a.work, exist_ok=True)
    runner = load_target(a.model, a.batch)
    layers = default_aux_layers(runner.config.num_layers)
    train, heldout = split_prompts(a.prompts, a.heldout)
    sets = {"train": train, "eval": heldout}
    if a.unseen:
        sets["unseen"] = unseen_prompts()
    for name, texts in sets.items():
        ids = [encode(runner, t) for t in texts]
        bar = progress_bar(len(ids), f"data {name}")
        t0 = time.perf_counter()
        recs = D.generate(runner, layers, ids, a.max_new, a.batch,
                          lambda n, tok, bar=bar: bar(n, f"{tok} tokens"))
        secs = time.perf_counter() - t0
        counts = D.token_counts(recs)
        meta = {"model": a.model, "aux_layer_ids": layers, "seconds": secs, **counts}
        D.save_records(os.path.join(a.work, f"{name}.pt"), recs, meta)
        print(f"\n{name}: {counts}, {secs:.0f} s", flush=True)


def cmd_train(a: argparse.Namespace) -> None:
    records, meta = D.load_records(os.path.join(a.work, "train.pt"))
    target = load_target(meta["model"], 1).model
    cfg = TrainConfig(epochs=a.epochs, batch=a.batch, ttt_steps=a.ttt_steps, lr=a.lr,
                      draft_vocab=a.draft_vocab, max_minutes=a.max_minutes)
    print(f"data: {D.token_counts(records)}, generated in {meta['seconds']:.0f} s", flush=True)

    def bar(total: int, done: int) -> Any:
        update = progress_bar(total, "train")
        update(done, "resumed" if done else "")
        return update
    head, state = train(target, meta["aux_layer_ids"], records, os.path.join(a.work, "ckpt.pt"),
                        cfg, bar)
    print(f"\ntrained {state['step']} steps, {state['tokens']} labelled tokens x "
          f"{cfg.ttt_steps} unrolled steps, {state['seconds'] / 60:.1f} min", flush=True)
    if a.out:
        size = export_head(head, a.out)
        print(f"head -> {a.out} ({size / 1e6:.1f} MB)")


def cmd_export(a: argparse.Namespace) -> None:
    _, meta = D.load_records(os.path.join(a.work, "eval.pt"))
    target = load_target(meta["model"], 1).model
    head = load_checkpoint(target, meta["aux_layer_ids"], os.path.join(a.work, "ckpt.pt"))
    print(f"head -> {a.out} ({export_head(head, a.out) / 1e6:.1f} MB)")


def cmd_eval(a: argparse.Namespace) -> None:
    out = {}
    for name in a.sets:
        records, meta = D.load_records(os.path.join(a.work, f"{name}.pt"))
        target = load_target(meta["model"], 1).model
        head = load_eagle3_head(a.head, target.config, target.embed.weight.detach())
        rows = {}
        for k in range(1, a.k + 1):
            rows[f"eagle3 k={k}"] = eagle_acceptance(head, records, k).__dict__
            rows[f"ngram k={k}"] = ngram_acceptance(records, k).__dict__
        for key, r in rows.items():
            r["length"] = round(r["tokens"] / max(1, r["steps"]), 3)
            print(f"{name} {key}: {r['length']} tokens/step, by position {r['by_position']}",
                  flush=True)
        out[name] = {"counts": D.token_counts(records), "rows": rows}
    with open(os.path.join(a.work, "eval.json"), "w") as f:
        json.dump(out, f, indent=1)


def progress_bar(total: int, desc: str) -> Any:
    """tqdm when installed (in the background it writes lines to the log); else a line."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, desc=desc, mininterval=5.0, file=sys.stdout)

        def update(n: int, note: str = "") -> None:
            bar.update(n - bar.n)
            bar.set_postfix_str(note, refresh=False)
            if n >= total:
                bar.close()
        return update

    def line(n: int, note: str = "") -> None:
        print(f"{desc}: {n}/{total} {note}", flush=True)
    return line


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--work", required=True)
    d.add_argument("--model", default="smollm2")
    d.add_argument("--prompts", type=int, default=240)
    d.add_argument("--heldout", type=float, default=0.15)
    d.add_argument("--max-new", type=int, default=128)
    d.add_argument("--batch", type=int, default=24)
    d.add_argument("--unseen", action=argparse.BooleanOptionalAction, default=True,
                   help="also the chat benchmark's prompts (scripts/workloads/chat.jsonl)")
    t = sub.add_parser("train")
    t.add_argument("--work", required=True)
    t.add_argument("--epochs", type=int, default=10)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--ttt-steps", type=int, default=3)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--draft-vocab", type=int, default=8192)
    t.add_argument("--max-minutes", type=float, default=1e9,
                   help="stop and checkpoint after this long (a rerun resumes)")
    t.add_argument("--out", help="export the head here (EAGLE layout, bf16) when done")
    x = sub.add_parser("export", help="export the head in W/ckpt.pt (a run stopped early)")
    x.add_argument("--work", required=True)
    x.add_argument("--out", required=True)
    e = sub.add_parser("eval")
    e.add_argument("--work", required=True)
    e.add_argument("--head", required=True, help="an exported head folder")
    e.add_argument("--sets", nargs="+", default=["eval", "unseen"])
    e.add_argument("-k", type=int, default=5)
    for s in (d, t, x, e):
        s.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    {"data": cmd_data, "train": cmd_train, "export": cmd_export, "eval": cmd_eval}[a.cmd](a)


if __name__ == "__main__":
    main()
