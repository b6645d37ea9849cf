"""Found by the soak: a greedy request's output must not depend on when it joins the batch.

In-process engine (no Ray), no speculation (draft none): 8 greedy requests through 4 slots, so
the last 4 are admitted into slots freed by the first 4 while other requests may still run.
Every output must be the target's own greedy continuation of its prompt.
"""

from __future__ import annotations

import asyncio

import pytest
from support.reference_decode import greedy_reference

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine, collect
from pipeline.models.runners import build_runner
from pipeline.params import SamplingParams

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["The quick brown fox", "Once upon a time", "hello", "0123456789", "a b c d e f"]


@pytest.mark.parametrize("draft", ["none", "model"])
def test_greedy_output_is_the_same_whether_admitted_first_or_into_a_reused_slot(draft):
    config = load_config("configs/tiny.yaml", {"num_slots": 4, "draft": draft})
    ref_runner = build_runner(load_config("configs/tiny.yaml", {"draft": "none"}))
    tok = ref_runner.tokenizer
    ids = {p: list(tok.encode(p)) for p in PROMPTS}
    ref = {p: greedy_reference(ref_runner, ids[p], 64) for p in PROMPTS}
    lengths = [14, 61, 27, 43, 43, 49, 61, 26]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in (2, 0, 1, 3, 0, 4, 0, 0)]
    requests = [(f"r{i}", ids[p], SamplingParams(max_new_tokens=n, ignore_eos=True))
                for i, (p, n) in enumerate(zip(prompts, lengths))]
    out = asyncio.run(collect(build_local_engine(config), requests))
    assert list(out) == [r[0] for r in requests]
    first_diff = {}
    for i, (rid, c) in enumerate(out.items()):
        want = ref[prompts[i]][: len(c.token_ids)]
        if c.token_ids != want:
            first_diff[rid] = next(j for j, (x, y) in enumerate(zip(c.token_ids, want)) if x != y)
    assert all(len(c.token_ids) == n for c, n in zip(out.values(), lengths))
    assert first_diff == {}  # request id -> index of its first wrong token
