"""SmolLM2-135M (real GGUF weights): JSON-schema-constrained n-gram speculation is token for token
constrained target-only greedy decoding, and the output validates against the schema."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine, collect
from pipeline.grammar.llg import compile_grammar
from pipeline.params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 3}}}


def test_smollm2_constrained_ngram_equals_constrained_target_only():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        overrides = {"num_slots": 4, "max_model_len": 256}
        none = build_local_engine(load_config("configs/smollm2-cpu.yaml",
                                              {**overrides, "draft": "none"}))
        runner = none.stages.verifier.runner
        # 1-token matches too: these short answers hold few longer ones, and drafts must be tried
        ngram = build_local_engine(load_config("configs/smollm2-cpu.yaml",
                                               {**overrides, "ngram_min_n": 1}), runner)
        tok = runner.tokenizer
        grammar = compile_grammar("json_schema", SCHEMA, tok)
        reqs = []
        for i, who in enumerate(["Ann, 31, tags a and b", "Bob, 45, tag c", "Cy, 7, no tags"]):
            text = f"Give JSON with name, age and tags for: {who}. JSON:"
            ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                          add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            reqs.append((f"j{i}", ids, SamplingParams(max_new_tokens=48, grammar=grammar)))
        ref = asyncio.run(collect(none, reqs))
        spec = asyncio.run(collect(ngram, reqs))
    finally:
        torch.set_num_threads(threads)
    for rid, _, _ in reqs:
        assert spec[rid].token_ids == ref[rid].token_ids, rid
        assert spec[rid].finish_reason == "stop", spec[rid].text
        jsonschema.validate(json.loads(spec[rid].text), SCHEMA)
    assert ngram.stats.draft_tokens > 0
