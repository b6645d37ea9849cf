"""scripts/train_eagle3.py: data capture, the training-time-test forward against the drafter's
own chaining, and a tiny-model run that resumes to the same weights."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from support.paths import ROOT

sys.path.insert(0, ROOT)

from pipeline.draft.eagle3 import load_eagle3_head
from scripts import train_eagle3
from scripts.eagle3_train import data as D
from scripts.eagle3_train.evaluate import eagle_acceptance, ngram_acceptance, replay
from scripts.eagle3_train.train import TrainConfig, build_head, train
from scripts.eagle3_train.unroll import pick_draft_vocab, unrolled_hidden

LAYERS = [2, 4, 5]  # the tiny 8-layer target's default aux layers


@pytest.fixture(scope="module")
def tiny():
    return train_eagle3.load_target("tiny", 4)


@pytest.fixture(scope="module")
def records(tiny):
    prompts = [train_eagle3.encode(tiny, t) for t in ("Hello there", "Write a list.",
                                                       "Why is the sky blue?", "Sort it")]
    return D.generate(tiny, LAYERS, prompts, max_new=12, batch=3)


def test_aux_states_are_the_residual_stream_a_single_forward_gives(tiny, records):
    """Captured while decoding in a batch of 3, then 1; recomputed here in one prefill."""
    r = records[3]
    capture = D.AuxCapture(tiny.model, LAYERS)
    slot = tiny.allocate()
    try:
        tiny.forward([slot], [r.tokens[:-1].tolist()])
        fresh = capture.rows()
    finally:
        capture.close()
        tiny.free(slot)
    assert r.aux.shape == (len(r.tokens) - 1, 3 * tiny.config.hidden_size)
    assert torch.allclose(r.aux.float(), fresh.float(), atol=2e-2, rtol=1e-2)
    assert len(r.tokens) - r.prompt_len == 12  # greedy ran to max_new (no EOS drawn)


def test_unrolled_steps_match_the_heads_own_chained_drafting(tiny, records):
    """Step 0 is the head fed target states over the whole sequence; step s at row p is the
    chain a drafter builds after pair p: (token p+1+s, the head's previous output)."""
    torch.manual_seed(0)
    draft_ids = pick_draft_vocab(records, 64, tiny.config.vocab_size, [2])
    head = build_head(tiny.model, LAYERS, draft_ids).eval()
    r = records[0]
    tokens = torch.cat([r.tokens, torch.zeros(4, dtype=torch.long)])
    with torch.no_grad():
        outs = unrolled_hidden(head, r.aux.float()[None], tokens[None], steps=3)
        cache = head.new_cache()
        full = head(r.tokens[1:].clone(), head.fuse(r.aux.float()), [cache], [len(r.aux)])
        assert torch.allclose(outs[0][0], full, atol=1e-4)
        for p in (0, 5, len(r.aux) - 4):
            cache = head.new_cache()
            last = head(r.tokens[1:p + 2].clone(), head.fuse(r.aux[:p + 1].float()), [cache],
                        [p + 1])[-1:]
            for s in (1, 2):
                last = head(r.tokens[p + 1 + s:p + 2 + s].clone(), last, [cache], [1])
                assert torch.allclose(outs[s][0, p], last[0], atol=1e-4), (p, s)


def test_training_resumes_to_the_weights_of_an_unbroken_run(tmp_path, tiny, records):
    cfg = TrainConfig(epochs=3, batch=2, draft_vocab=48, save_every=1)
    whole, state = train(tiny.model, LAYERS, records, str(tmp_path / "a.pt"), cfg)
    assert state["step"] == 6 and state["tokens"] == 3 * 4 * 12  # every generated token, each epoch
    broken = TrainConfig(**{**cfg.__dict__, "max_minutes": 0.0})  # stops after each step
    for step in range(1, 7):
        resumed, state = train(tiny.model, LAYERS, records, str(tmp_path / "b.pt"), broken)
        assert state["step"] == step
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_the_cli_trains_exports_a_head_the_loader_reads_and_evaluates(tmp_path, tiny):
    work, out = str(tmp_path / "w"), str(tmp_path / "head")
    train_eagle3.main(["data", "--work", work, "--model", "tiny", "--prompts", "12",
                       "--max-new", "10", "--batch", "4", "--no-unseen"])
    train_eagle3.main(["train", "--work", work, "--epochs", "2", "--batch", "4",
                       "--draft-vocab", "64", "--out", out])
    head = load_eagle3_head(out, tiny.config, tiny.model.embed.weight.detach())
    assert head.aux_layer_ids == LAYERS and head.config.draft_vocab_size == 64
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    records, _ = D.load_records(os.path.join(work, "eval.pt"))
    for k in (1, 3):
        for acc in (eagle_acceptance(head, records, k), ngram_acceptance(records, k)):
            produced = sum(len(r.tokens) - r.prompt_len - 1 for r in records)
            assert acc.tokens == produced  # the replay walks every generated token once
            assert len(acc.by_position) == k and 1.0 <= acc.length <= k + 1


def test_the_replay_counts_kept_drafts_plus_the_targets_own_token():
    r = D.Record(torch.arange(10, 20), 2, torch.zeros(9, 1))  # 8 tokens after the prompt's
    perfect = replay([r], 3, lambda active, ns, _: [r.tokens[n + 1:n + 4].tolist() for n in ns])
    # from newest index 2: keep 3 + 1 -> 6, keep 3 + 1 -> 10 (the end): 7 tokens in 2 steps
    assert (perfect.steps, perfect.tokens, perfect.by_position) == (2, 7, [1.0, 1.0, 1.0])
    wrong = replay([r], 1, lambda active, ns, _: [[0] for _ in ns])
    assert (wrong.steps, wrong.tokens, wrong.length, wrong.by_position) == (7, 7, 1.0, [0.0])
    second = replay([r], 2, lambda active, ns, _: [[r.tokens[n + 1].item(), 0] for n in ns])
    assert (second.steps, second.tokens, second.by_position) == (4, 7, [1.0, 0.0])
