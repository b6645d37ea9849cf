"""scripts/batch_generate.py input lines: structured output parameters become a compiled grammar,
and a bad one is that line's error (validated like the HTTP API), without Ray."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from support.serve_helpers import ROOT
from support.server_fakes import FakeEngine

from pipeline.frontend.tokenizer import TokenizerAdapter
from pipeline.models.runners import tiny_tokenizer

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import batch_generate

TOK = TokenizerAdapter(tiny_tokenizer())


def parse(line: dict) -> batch_generate.Item:
    return batch_generate.parse_line(0, json.dumps(line), TOK, max_model_len=256,
                                     vocab_size=256, default_max_tokens=8)


def test_guided_regex_and_response_format_lines_carry_a_grammar():
    regex = parse({"prompt": "a", "guided_regex": "[ab]{3}"})
    schema = parse({"messages": [{"role": "user", "content": "hi"}],
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "x", "schema": {"type": "object"}}}})
    free = parse({"prompt": "a"})
    assert regex.error is None and regex.params.grammar is not None
    assert schema.error is None and schema.params.grammar is not None
    assert free.error is None and free.params.grammar is None


def test_a_bad_regex_is_the_lines_error_naming_the_parameter():
    item = parse({"prompt": "a", "guided_regex": "[unclosed"})
    assert item.params is None and item.error.startswith("guided_regex:")


def test_the_jobs_final_prompt_tells_the_engine_its_batch_drains():
    engine = FakeEngine()
    items = [parse({"prompt": "a"}), parse({"prompt": "b"}),
             parse({"prompt": "c", "guided_regex": "[unclosed"})]  # a line that cannot run
    for i, item in enumerate(items):
        item.index = i
    _, rows = asyncio.run(batch_generate.generate_all(engine, items, concurrency=1,
                                                      progress_every=60))
    assert [r["error"] is None for r in rows] == [True, True, False]
    assert [rid.rsplit("-", 1)[1] for rid in engine.lasts] == ["1"]  # the last that runs
