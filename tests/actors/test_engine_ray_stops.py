"""The engine on Ray at TP = 2 (two verifier actors), n-gram drafts, adaptive k: a stop id or stop
string fires at the reference position, in the step whose window holds it, after an earlier step
rejected drafts.

Each case gets a fresh engine. Adaptive k follows measured step times and what the engine learned
from earlier requests, so on a shared engine a run may draft too little to reject anything (CI on
a loaded VM: eight runs in a row drafted nothing). A fresh engine's first drafted step at a batch
size measures what its verify rows cost (`EXPLORE_K` drafts, every one verified), so the first
draft the proposer has is verified whatever the timings say."""

from __future__ import annotations

import asyncio

import pytest
from support.engine_cases import LOSSY_PROMPT, ids  # n-gram drafts of LOSSY_PROMPT get rejected
from support.reference_decode import greedy_reference

from actors.engine import start_engine, stop_engine
from actors.engine_client import EngineClient
from pipeline.config import load_config
from pipeline.models.runners import build_runner
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

@pytest.fixture
def fresh_tp2(ray_cluster):
    config = load_config("configs/tiny-tp2.yaml", {"draft": "ngram"})
    assert config.speculation == "adaptive"
    handle = start_engine(config)
    yield handle
    stop_engine(handle)


async def _generate(handle, rid: str, params: SamplingParams) -> list:
    return [d async for d in EngineClient(handle).generate(EngineCall(rid, LOSSY_PROMPT, params))]


@pytest.mark.parametrize("kind", ["stop_id", "stop_string"])
def test_tp2_adaptive_stop_fires_in_the_reference_step_after_rejected_drafts(fresh_tp2, kind):
    runner = build_runner(load_config("configs/tiny.yaml", {"draft": "none"}))
    ref = greedy_reference(runner, LOSSY_PROMPT, 40)
    f = next(p for p in range(12, len(ref)) if ref[p] not in ref[:p] and ref[p] != 2)
    matched = ref[f] if kind == "stop_id" else runner.tokenizer.decode([ref[f]])
    params = (SamplingParams(max_new_tokens=40, stop_token_ids=[matched]) if kind == "stop_id"
              else SamplingParams(max_new_tokens=40, stop=[matched]))
    info = asyncio.run(EngineClient(fresh_tp2).model_info())
    assert info["tensor_parallel_size"] == 2

    deltas = asyncio.run(_generate(fresh_tp2, f"lossy-{kind}", params))
    last = deltas[-1]
    windows = [(d.token_ids, d.spec_draft_tokens, d.text) for d in deltas] + [ref[:f + 2]]
    assert (last.finish_reason, last.matched_stop, last.finished_len) == \
        ("stop", matched, f + 1), windows
    assert ids(deltas) == ref[:f + 1]
    # one delta per step: the stop's window is the last step's
    before = sum(len(d.token_ids) for d in deltas[:-1])
    assert before <= f < before + len(last.token_ids) and last.finish_step is not None
    # per step before the last: drafts verified and drafts accepted
    drafts = [0] + [d.spec_draft_tokens for d in deltas[:-1]]
    accepted = [0] + [d.spec_accepted_tokens for d in deltas[:-1]]
    steps = [(drafts[i + 1] - drafts[i], accepted[i + 1] - accepted[i])
             for i in range(len(deltas) - 1)]
    assert any(drafted > kept for drafted, kept in steps), steps  # a step rejected drafts
    assert len({drafted for drafted, _ in steps}) > 1, steps  # k varied between steps
