"""The null model (`model: null:<forward ms>`): the engine's step without model math, for the
step-overhead benchmark. Its greedy output is known in advance, so the engine's output over it is
checked against that sequence, not against another run of the engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.config import load_config, parse_null_source, resolve_source
from pipeline.engine.local import build_local_engine, collect
from pipeline.models.null import next_token, null_config
from pipeline.models.runners import load_runner
from pipeline.params import SamplingParams


@pytest.mark.parametrize(("source", "ms"), [("null", 0.0), ("null:0", 0.0), ("null:2.5", 2.5),
                                            ("tiny:0", None), ("nullable.gguf", None)])
def test_null_sources_name_their_forward_time(source, ms):
    assert parse_null_source(source) == ms


@pytest.mark.parametrize("source", ["null:x", "null:-1", "null:nan"])
def test_a_bad_null_source_is_a_value_error_naming_the_field(source):
    with pytest.raises(ValueError, match="model: .*null"):
        resolve_source(source)


def test_successor_skips_end_of_sequence_and_wraps():
    cfg = null_config()
    eos = cfg.eos_token_ids[0]
    assert next_token(eos - 1, cfg.vocab_size, cfg.eos_token_ids) == eos + 1
    assert next_token(cfg.vocab_size - 1, cfg.vocab_size, cfg.eos_token_ids) == 0


def test_runner_logits_pick_the_successor_and_the_forward_sleeps():
    runner = load_runner("null:20", num_slots=2, max_len=32)
    slot = runner.allocate()
    t0 = time.perf_counter()
    logits = runner.forward([slot], [[5, 6, 1]])[0]
    assert time.perf_counter() - t0 >= 0.02
    assert logits.argmax(-1).tolist() == [6, 7, 3]  # 2 is the end-of-sequence id
    assert runner.length(slot) == 3


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_engine_over_the_null_model_outputs_its_known_sequence(draft):
    config = load_config("configs/tiny.yaml", {"model": "null:0", "draft": draft,
                                               "draft_model": None})
    core = build_local_engine(config)
    prompts = {f"r{i}": [10 + i, 11 + i, 12 + i, 10 + i, 11 + i] for i in range(5)}
    params = SamplingParams(max_new_tokens=20)
    done = asyncio.run(collect(core, [(rid, p, params) for rid, p in prompts.items()]))
    cfg = null_config()
    for rid, prompt in prompts.items():
        want, tok = [], prompt[-1]
        for _ in range(20):
            tok = next_token(tok, cfg.vocab_size, cfg.eos_token_ids)
            want.append(tok)
        assert done[rid].token_ids == want
        assert done[rid].finish_reason == "length"
