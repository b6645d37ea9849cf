"""Compiled grammars under a per-process byte budget (pipeline.grammar.memory): references while
requests use them, least-recently-used release of the unused beyond the budget, a 400 for one
grammar alone over it, and RSS that stays flat over many distinct hostile grammars."""

from __future__ import annotations

import asyncio
import gc

import llguidance
import pytest

from pipeline.grammar import memory
from pipeline.grammar.llg import Grammar, compile_grammar, grammar_matcher
from pipeline.grammar.memory import BYTES_PER_CHAR, GrammarMemory, rss_bytes, set_memory_budget
from pipeline.models.runners import tiny_tokenizer

TOK = tiny_tokenizer()
MB = 1 << 20


class Template:
    def __init__(self, name: str) -> None:
        self.name = name


def build(name: str):
    return lambda: Template(name)


def test_unreferenced_templates_go_least_recently_used_first_beyond_the_budget():
    mem = GrammarMemory(budget=3 * 100 * BYTES_PER_CHAR)
    keys = [(1, c * 100) for c in "abcd"]  # each estimated at 100 chars x BYTES_PER_CHAR
    _, a = mem.acquire(keys[0], build("a"))
    _, b = mem.acquire(keys[1], build("b"))
    mem.acquire(keys[2], build("c"))
    mem.release(b)
    mem.release(a)
    mem.acquire(keys[1], build("b2"))  # b used again: a is now the least recently used
    mem.release(b)
    mem.acquire(keys[3], build("d"))
    assert len(mem) == 3 and keys[0] not in mem._entries  # a went, not b
    assert mem.total <= mem.budget


def test_templates_in_use_are_never_dropped_and_released_ones_go_once_over_budget():
    mem = GrammarMemory(budget=100 * BYTES_PER_CHAR)
    t1, e1 = mem.acquire((1, "x" * 100), build("x"))
    _, e2 = mem.acquire((1, "y" * 100), build("y"))  # over budget, but both in use
    assert len(mem) == 2
    again, _ = mem.acquire((1, "x" * 100), build("x-rebuilt"))
    assert again is t1  # a hit, no rebuild
    mem.release(e2)
    assert len(mem) == 1 and mem.total <= mem.budget  # y released and dropped
    mem.charge(e1, 10 * MB)  # masks grew x's store
    assert e1.size > 10 * MB and len(mem) == 1  # still in use (twice): kept


def test_a_matcher_holds_its_grammar_until_it_is_dropped():
    grammar = compile_grammar("regex", "[a-z]{3}", TOK)
    m = grammar_matcher(grammar, TOK)
    (entry,) = [e for k, e in memory.MEMORY._entries.items() if k[1] == grammar.compiled]
    refs = entry.refs
    assert refs >= 1
    second = grammar_matcher(grammar, TOK)
    assert entry.refs == refs + 1
    del m, second
    gc.collect()
    assert entry.refs == refs - 1


def test_a_grammar_alone_over_the_budget_is_refused_up_front(monkeypatch):
    monkeypatch.setattr(memory.MEMORY, "budget", 1 * MB)
    big = "(" + "|".join(f"k{i:05d}" for i in range(3000)) + ")"  # ~21 KB of regex
    assert len(llguidance.grammar_from("regex", big)) * BYTES_PER_CHAR > 1 * MB
    with pytest.raises(ValueError, match="over this server's grammar memory budget of 1 MB"):
        compile_grammar("regex", big, TOK)
    monkeypatch.setattr(memory.MEMORY, "budget", 256 * MB)
    assert compile_grammar("regex", big, TOK).kind == "regex"


def test_over_http_a_grammar_over_the_budget_is_a_400(monkeypatch):
    from support.server_fakes import FakeEngine, call, check_openai_error

    from pipeline.frontend.app import create_app
    from pipeline.frontend.settings import ServerSettings

    monkeypatch.setattr(memory.MEMORY, "budget", 1 * MB)
    engine = FakeEngine()
    big = "(" + "|".join(f"k{i:05d}" for i in range(3000)) + ")"
    r = asyncio.run(call(create_app(engine, TOK, ServerSettings()), "POST", "/v1/completions",
                         {"prompt": "hi", "max_tokens": 4, "guided_regex": big}))
    assert r.status_code == 400
    err = check_openai_error(r)
    assert err["code"] == "invalid_grammar" and "memory budget" in err["message"]
    assert engine.requests == {}


def test_the_budget_is_a_config_key():
    from pipeline.config import EngineConfig

    assert EngineConfig().grammar_memory_mb == 256
    with pytest.raises(ValueError, match="grammar_memory_mb"):
        EngineConfig(grammar_memory_mb=0)
    old = memory.MEMORY.budget
    try:
        set_memory_budget(64 * MB)
        assert memory.MEMORY.budget == 64 * MB
    finally:
        memory.MEMORY.budget = old


# ------------------------------------------------------------- RSS over many distinct grammars

def hostile(i: int) -> str:
    return f"({chr(ord('b') + i % 24)}{{1000}}){{{1000 + i // 24}}}"  # distinct for every i


def stage_side(tokenizer, n: int) -> tuple[int, int]:
    """What a verifier does with n distinct hostile grammars that reached it (compile checks
    bypassed): a matcher each, masks along a draft path, the request ends. (start, peak) RSS."""
    vocab = len(tokenizer)
    start = peak = rss_bytes()
    for i in range(n):
        g = Grammar("regex", llguidance.grammar_from("regex", hostile(i)))
        m = grammar_matcher(g, tokenizer)
        m.masks(tokenizer.encode(chr(ord("b") + i % 24) * 2, add_special_tokens=False)[:2],
                vocab)
        del m  # the request ended
        peak = max(peak, rss_bytes())
    return start, peak


def front_end_side(tokenizer, n: int) -> tuple[int, int]:
    """The front end compiling n distinct hostile regexes (each a 400). (start, peak) RSS."""
    start = peak = rss_bytes()
    for i in range(n):
        with pytest.raises(ValueError, match="too many expressions"):
            compile_grammar("regex", hostile(i), tokenizer)
        peak = max(peak, rss_bytes())
    return start, peak


def _fifty_in_a_fresh_process(smollm2_path: str) -> tuple[float, float]:
    """Both sides' RSS growth (MB) in a process of their own, as a stage or front end is: the
    test process's history (other tests' threads, arenas, caches) must not count."""
    import os

    from transformers import AutoTokenizer

    from pipeline.grammar.llg import lltokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))
    lltokenizer(tokenizer)  # built once per process at start-up, not part of the growth
    grammar_matcher(compile_grammar("regex", "[a-z]+", tokenizer), tokenizer)
    start, peak = stage_side(tokenizer, 50)
    stage = (peak - start) / MB
    start, peak = front_end_side(tokenizer, 50)
    return stage, (peak - start) / MB


@pytest.mark.slow
def test_fifty_distinct_hostile_grammars_keep_rss_within_300_mb_with_smollm2(smollm2_path):
    """The issue's sequence with the real 49k vocabulary, where one such grammar holds ~160 MB
    once masked: before the budget, 50 of them held ~8 GB in the verifier."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        stage, front_end = pool.apply(_fifty_in_a_fresh_process, (smollm2_path,))
    assert stage < 300 and front_end < 300, (stage, front_end)
