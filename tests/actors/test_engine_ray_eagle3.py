"""`draft: eagle3` on Ray: the verifier ranks (TP 2, prompts chunked by a small step budget)
send rank 0's aux hidden states in the outcome, the engine forwards them in the next plan to the
draft actor, and the output is target-only greedy's."""

from __future__ import annotations

import asyncio

import pytest
from support.eagle3_heads import eagle_config, head_tensors, write_head
from support.engine_cases import PROMPTS, expected_cut, ids, mixed_requests
from support.ray_engine import greedy_references, run_batch

from actors.engine import start_engine, stop_engine
from actors.engine_client import EngineClient
from pipeline.config import load_config
from pipeline.models.tiny import tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def test_ray_eagle3_tp2_greedy_equals_target_only(ray_cluster, tmp_path):
    target = tiny_config()  # tiny:0 has 2 layers: the head names the ones it reads
    write_head(tmp_path, eagle_config(target, eagle_aux_hidden_state_layer_ids=[0, 1, 1]),
               head_tensors(target, seed=5))
    handle = start_engine(load_config("configs/tiny-tp2.yaml", {
        "draft": "eagle3", "eagle3_head": str(tmp_path), "speculation": "fixed",
        "max_num_batched_tokens": 24}))
    try:
        reference = greedy_references()
        requests = mixed_requests(8)
        out = run_batch(handle, requests)
        for rid, prompt, params in requests:
            want_ids, _ = expected_cut(reference[PROMPTS.index(prompt)], params)
            assert ids(out[rid]) == want_ids
        stats = asyncio.run(EngineClient(handle).stats())
        assert stats["num_draft_tokens"] > 0 and stats["healthy"]
    finally:
        stop_engine(handle)
