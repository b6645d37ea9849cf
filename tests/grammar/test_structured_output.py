"""Structured output under speculation (llguidance grammars): constrained speculative decoding
equals constrained target-only decoding, outputs parse, a grammar completing inside a window ends
the request there, bad grammars are 400s, and rejection sampling stays exact under a mask."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.acceptance_cases import CASES, N, V, logits_of, lossless_pvalues, make_batch
from support.server_fakes import FakeEngine, call, check_openai_error

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine, collect
from pipeline.grammar.llg import compile_grammar
from pipeline.models.runners import tiny_tokenizer
from pipeline.output.processor import OutputProcessor
from pipeline.output.spans import TracedOutputProcessor
from pipeline.params import SamplingParams
from pipeline.protocol import VerifyStep, encode
from pipeline.sampling import SamplingTensors, process_logits
from pipeline.verify.acceptance import accept

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"
TOK = tiny_tokenizer()
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["ok", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"tag": {"enum": ["red", "green", "blue"]},
                                      "w": {"type": "string", "maxLength": 4}},
     "required": ["tag", "w"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 2, "maxItems": 4},
]
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma"]


def constrained_requests(n: int) -> list[tuple[str, list[int], SamplingParams, tuple]]:
    """(rid, prompt, params, (kind, source)) cycling through schemas, the regex and the choice."""
    sources = [("json_schema", s) for s in SCHEMAS] + [("regex", REGEX), ("choice", CHOICES)]
    out = []
    for i in range(n):
        kind, src = sources[i % len(sources)]
        params = SamplingParams(max_new_tokens=48, grammar=compile_grammar(kind, src, TOK))
        out.append((f"g{i}", [5 + i % 40, 6, 7, 8, 9 + i % 3], params, (kind, src)))
    return out


def check_valid(text: str, kind: str, src) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), src)
    elif kind == "regex":
        assert re.fullmatch(src, text), text
    else:
        assert text in src, text


def run(draft: str, requests):
    core = build_local_engine(load_config(CONFIG, {"draft": draft}))
    res = asyncio.run(collect(core, [r[:3] for r in requests]))
    return res, core


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_greedy_constrained_speculation_equals_constrained_target_only(draft):
    reqs = constrained_requests(10)
    reference, _ = run("none", reqs)
    spec, core = run(draft, reqs)
    for rid, _, _, (kind, src) in reqs:
        assert spec[rid].token_ids == reference[rid].token_ids, rid
        assert spec[rid].finish_reason == "stop", (rid, spec[rid].text)
        check_valid(spec[rid].text, kind, src)
    assert core.stats.draft_tokens > 0  # speculation really ran
    for c in spec.values():  # the stats identity holds with grammar-cut drafts
        last = c.last
        assert len(c.token_ids) == 1 + last.spec_verify_ct + last.spec_accepted_tokens


def test_drafts_the_grammar_rejects_are_cut_before_verification():
    from pipeline.draft.base import Proposal, Proposer
    from pipeline.draft.step import draft_step
    from pipeline.grammar.tracker import GrammarTracker
    from pipeline.protocol import NewRequest, StepPlan

    class Fixed(Proposer):  # proposes "ab9zz" whatever the sequence
        def add(self, rid, prompt_ids, params, tenant=""): ...
        def commit(self, rid, tokens): ...
        def remove(self, rid): ...

        def propose(self, rids, ks):
            return Proposal([[ord(c) for c in "ab9zz"][:k] for k in ks],
                            confidence=[[0.9, 0.8, 0.7, 0.6, 0.5][:k] for k in ks])

    grammar = compile_grammar("regex", "[a-z]+9[0-9]", TOK)
    tracker = GrammarTracker(lambda: TOK)
    new = [NewRequest("g", [5], SamplingParams(grammar=grammar)),
           NewRequest("u", [5], SamplingParams())]
    draft_step(Fixed(), StepPlan(0, new=new), tracker)
    plan = StepPlan(1, decode=["g", "u"], ks=[5, 5], commits={"g": [ord("x")], "u": [ord("x")]})
    proposal = draft_step(Fixed(), plan, tracker)
    assert proposal.tokens == [[ord(c) for c in "ab9"], [ord(c) for c in "ab9zz"]]
    assert proposal.confidence == [[0.9, 0.8, 0.7], [0.9, 0.8, 0.7, 0.6, 0.5]]


def test_grammar_completing_mid_window_ends_the_request_there():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    proc = TracedOutputProcessor(OutputProcessor(TOK, eos_token_ids=[2]),
                                 tracer=provider.get_tracer("test"))
    grammar = compile_grammar("regex", "ab[0-9]", TOK)
    proc.add_request("r", [5], SamplingParams(max_new_tokens=20, logprobs=0, grammar=grammar))
    ids = [ord(c) for c in "a"], [ord(c) for c in "b7cd"]
    outs = []
    for step, window in enumerate(ids):
        outs += proc.process(encode(VerifyStep(step, ["r"], [window], [len(window) - 1],
                                               logprobs=[[-0.5] * len(window)])))
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == [ord(c) for c in "ab7"]
    assert sum(len(o.logprobs) for o in outs) == 3
    assert "".join(o.text for o in outs) == "ab7"
    last = outs[-1]
    assert (last.finished, last.finish_reason, last.finished_len, last.finish_step) == (
        True, "stop", 3, 1)
    assert last.spec_accepted_tokens == 1  # "b" accepted, "7" kept; "cd" dropped from stats
    events = [e for s in exporter.get_finished_spans() if s.name == "spec.verify_step"
              for e in s.events if e.name == "spec.finish"]
    assert len(events) == 1
    assert events[0].attributes["finish.window_position"] == 1
    assert events[0].attributes["finish.len"] == 3


def test_fifty_concurrent_constrained_requests_mixed_with_free_ones_are_all_valid():
    reqs = constrained_requests(50)
    free = [(f"u{i}", [30 + i, 31], SamplingParams(max_new_tokens=24, ignore_eos=True), None)
            for i in range(10)]
    res, _ = run("ngram", reqs + free)
    for rid, _, _, (kind, src) in reqs:
        check_valid(res[rid].text, kind, src)
    alone, _ = run("ngram", free)  # free requests are untouched by constrained neighbours
    assert all(res[r[0]].token_ids == alone[r[0]].token_ids for r in free)
    assert all(len(res[r[0]].token_ids) == 24 for r in free)


@pytest.mark.parametrize(("kind", "source", "needle"), [
    ("regex", "a((", "unclosed group"),
    ("json_schema", {"type": "objx"}, "objx"),
    ("regex", "€+", "can satisfy"),  # the tiny vocabulary has no token for U+20AC
    ("choice", [], "non-empty list"),
])
def test_bad_or_unsatisfiable_grammars_are_value_errors_naming_them(kind, source, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        compile_grammar(kind, source, TOK)


def test_masked_rejection_sampling_is_lossless():

    allowed = torch.ones(3, V, dtype=torch.bool)
    allowed[0, [0, 4]] = False  # the far draft's favourite tokens are disallowed
    allowed[1, 2] = False
    allowed[2, 5] = False
    for name in ("q_far", "point_mass", "top_k_top_p_model_draft"):
        case = CASES[name]
        gen = torch.Generator().manual_seed(1)
        logits, _, q, drafts, num_drafts = make_batch(case, gen)
        sampling = SamplingTensors.from_params([SamplingParams(
            temperature=case.temperature, top_k=case.top_k, top_p=case.top_p)] * 3)
        p = process_logits(logits_of(case.target).masked_fill(~allowed, float("-inf")),
                           sampling.temperature, sampling.top_k, sampling.top_p)
        rows = SamplingTensors.from_params([SamplingParams(
            temperature=case.temperature, top_k=case.top_k, top_p=case.top_p)] * N)
        res = accept(drafts, num_drafts, logits, rows, [0] * N, q, generator=gen,
                     allowed=allowed.expand(N, -1, -1))
        pvalues = lossless_pvalues(res.token_ids, res.num_tokens, p)
        assert len(pvalues) >= 2 and min(pvalues) > 1e-3, (name, pvalues)
        emitted = res.token_ids[:, 0][res.num_tokens >= 1]
        assert not bool(((emitted == 0) | (emitted == 4)).any())


def test_masked_greedy_picks_the_best_allowed_token_and_keeps_raw_logprobs():
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0]]])
    allowed = torch.tensor([[[True, False, False, True]]])
    sampling = SamplingTensors.from_params([SamplingParams()])
    res = accept(torch.zeros((1, 0), dtype=torch.int64), torch.tensor([0]), logits, sampling,
                 [0], allowed=allowed)
    assert res.token_ids.tolist() == [[3]]
    assert res.logprobs[0, 0].item() == pytest.approx(
        torch.log_softmax(logits[0, 0], -1)[3].item())


# --------------------------------------------------------------------------- HTTP front end

BAD_BODIES = [
    ({"guided_regex": "a(("}, "guided_regex", "unclosed group"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objx"}}}},
     "response_format.json_schema.schema", "objx"),
    ({"guided_regex": "€+"}, "guided_regex", "can satisfy"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice", "at most one"),
]


@pytest.mark.parametrize(("extra", "param", "needle"), BAD_BODIES,
                         ids=[b[1] + "-" + b[2] for b in BAD_BODIES])
def test_bad_structured_output_is_a_400_before_any_slot_and_the_server_stays_healthy(
        extra, param, needle):

    from pipeline.frontend.app import create_app
    from pipeline.frontend.settings import ServerSettings

    engine = FakeEngine()
    app = create_app(engine, TOK, ServerSettings())
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = asyncio.run(call(app, "POST", path, {**body, "max_tokens": 4, **extra}))
        assert r.status_code == 400, r.text
        err = check_openai_error(r)
        assert err["param"] == param and needle in err["message"], err
    assert engine.requests == {}  # nothing reached the engine
    assert asyncio.run(call(app, "GET", "/health")).status_code == 200
    ok = asyncio.run(call(app, "POST", "/v1/completions",
                          {"prompt": "hi", "max_tokens": 2, "guided_regex": "[a-z]+"}))
    assert ok.status_code == 200, ok.text


def test_structured_output_parameters_reach_the_engine_as_a_compiled_grammar():

    from pipeline.frontend.app import create_app
    from pipeline.frontend.settings import ServerSettings
    from pipeline.grammar.llg import Grammar

    engine = FakeEngine()
    app = create_app(engine, TOK, ServerSettings())
    bodies = [{"response_format": {"type": "json_object"}},
              {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMAS[0]}}},
              {"guided_json": SCHEMAS[1]}, {"guided_regex": REGEX}, {"guided_choice": CHOICES},
              {"response_format": {"type": "text"}}]
    for body in bodies:
        r = asyncio.run(call(app, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}))
        assert r.status_code == 200, r.text
    kinds = [p.grammar.kind if isinstance(p.grammar, Grammar) else p.grammar
             for p in engine.requests.values()]
    assert kinds == ["json_schema", "json_schema", "json_schema", "regex", "choice", None]


# --------------------------------------------------------------------------- dead ends and limits

SELF_REFERENTIAL = {"type": "object", "properties": {"self": {"$ref": "#"}},
                    "required": ["self"]}
MANY_OPTIONAL = {"type": "object",
                 "properties": {f"p{i}": {"type": "integer"} for i in range(1200)}}
SIX_THOUSAND_WORDS = [f"w{i:04d}x" for i in range(6000)]
# The issue's hostile grammars: each returned 200 `stop` with output the grammar rejects.
HOSTILE = [
    ("json_schema", SELF_REFERENTIAL, "no finite JSON value"),
    ("regex", "(ab){500000}", "too many expressions"),
    ("regex", "a{1000000}", "too many expressions"),
    ("regex", "(a{1000}){1000}", "too many expressions"),
    ("choice", SIX_THOUSAND_WORDS, "max is 2000"),
    ("json_schema", MANY_OPTIONAL, "max is 2000"),
]
HOSTILE_IDS = ["self-ref-schema", "ab500000", "a1000000", "a1000x1000", "choice6000",
               "1200-optional"]


@pytest.mark.parametrize(("kind", "source", "needle"), HOSTILE, ids=HOSTILE_IDS)
def test_grammars_that_dead_end_or_hit_llguidance_limits_are_refused_at_compile_time(
        kind, source, needle):
    with pytest.raises(ValueError, match=re.escape(needle)) as e:
        compile_grammar(kind, source, TOK)
    assert str(e.value).startswith(f"{kind}: ")
    assert "<state>" not in str(e.value) and "Tokens:" not in str(e.value)  # no parser dumps


@pytest.mark.parametrize("schema", [
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/m"}},
                     "required": ["next"]},
               "m": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}},
     "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}},
     "required": ["a"]},
    {"type": "object", "properties": {"a": False}, "required": ["a"]},
])
def test_schemas_without_a_finite_instance_are_refused(schema):
    with pytest.raises(ValueError, match="no finite JSON value"):
        compile_grammar("json_schema", schema, TOK)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"self": {"$ref": "#"}}},  # optional: {} ends it
    {"$defs": {"n": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}, "required": ["next"]}},
     "$ref": "#/$defs/n"},  # a linked list ending in null
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
])
def test_recursive_schemas_with_a_finite_instance_still_compile(schema):
    assert compile_grammar("json_schema", schema, TOK).kind == "json_schema"


def unchecked_grammar(kind: str, source):
    """The compiled grammar as compile_grammar would hand it on, without its checks: what a
    limit met only later in the output looks like to the engine."""
    import llguidance
    from llguidance import LLMatcher

    from pipeline.grammar.llg import JSON_OPTIONS, Grammar

    text = source if isinstance(source, str) else json.dumps(source)
    if kind == "json_schema":
        return Grammar(kind, LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS))
    return Grammar(kind, llguidance.grammar_from(kind, text))


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_a_dead_end_or_limit_met_while_generating_ends_the_request_with_an_error(draft):
    reqs = [(f"h{i}", [5, 6, 7, 8], SamplingParams(max_new_tokens=24,
                                                   grammar=unchecked_grammar(kind, src)))
            for i, (kind, src, _) in enumerate(HOSTILE)]
    reqs.append(("ok", [5, 6, 7, 8], SamplingParams(
        max_new_tokens=48, grammar=compile_grammar("regex", REGEX, TOK))))
    res, _ = run(draft, reqs)
    for i, (_, _, needle) in enumerate(HOSTILE):
        c = res[f"h{i}"]
        assert (c.finish_reason, c.finish_kind) == ("error", "grammar_error"), (i, c.text)
        # the limit's own words, or the token the grammar rejected after the dead end
        assert needle in c.last.error or "satisfy the grammar" in c.last.error, c.last.error
    assert res["ok"].finish_reason == "stop"  # a neighbour is untouched
    check_valid(res["ok"].text, "regex", REGEX)


def test_the_verifier_leaves_a_dead_end_row_unconstrained_and_the_matcher_reports_it():
    from pipeline.grammar.llg import grammar_matcher

    m = grammar_matcher(unchecked_grammar("regex", "a{1000000}"), TOK)
    rows = m.masks([ord("a"), ord("a")], 256)
    assert rows.shape == (3, 256)
    assert rows[1:].all()  # past the limit: no all-masked row (never a hang)
    assert m.is_dead() and "too many expressions" in m.error()
    ok = grammar_matcher(compile_grammar("regex", "ab", TOK), TOK)
    assert ok.accept_token(ord("a")) and ok.error() is None
    assert not ok.accept_token(ord("x")) and "satisfy the grammar" in ok.error()


HTTP_HOSTILE = [({"guided_regex": "(ab){500000}"}, "guided_regex", "too many expressions"),
                ({"guided_regex": "a{1000000}"}, "guided_regex", "too many expressions"),
                ({"guided_choice": SIX_THOUSAND_WORDS}, "guided_choice", "max is 2000"),
                ({"guided_json": SELF_REFERENTIAL}, "guided_json", "no finite JSON value"),
                ({"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": MANY_OPTIONAL}}},
                 "response_format.json_schema.schema", "max is 2000")]


@pytest.mark.parametrize(("extra", "param", "needle"), HTTP_HOSTILE,
                         ids=["ab500000", "a1000000", "choice6000", "self-ref", "1200-optional"])
def test_hostile_grammars_are_a_400_naming_the_limit_before_the_engine(extra, param, needle):

    from pipeline.frontend.app import create_app
    from pipeline.frontend.settings import ServerSettings

    engine = FakeEngine()
    app = create_app(engine, TOK, ServerSettings())
    r = asyncio.run(call(app, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}))
    assert r.status_code == 400, r.text
    err = check_openai_error(r)
    assert (err["param"], err["code"]) == (param, "invalid_grammar")
    assert needle in err["message"], err
    assert engine.requests == {}


def grammar_error_engine():
    """A FakeEngine whose requests end as the output stage ends one whose grammar dead-ends:
    some output, then a finished delta with reason "error"."""

    from pipeline.output.request_output import RequestOutput

    class DeadEndEngine(FakeEngine):
        async def _outputs(self, rid, params):
            yield RequestOutput(rid, token_ids=[ord("{")], text="{", spec_verify_ct=0)
            await asyncio.sleep(0.05)  # a later step: a stream has sent its headers by then
            yield RequestOutput(rid, token_ids=[ord('"')], text='"', finished=True,
                                finish_reason="error", finish_kind="grammar_error",
                                finished_len=2, error="lexer error: too many expressions "
                                "constructed")

    return DeadEndEngine()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_grammar_error_while_generating_is_an_error_body_never_a_stop_choice(path):

    from pipeline.frontend.app import create_app
    from pipeline.frontend.settings import ServerSettings

    body = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
            else {"prompt": "hi"})
    app = create_app(grammar_error_engine(), TOK, ServerSettings())
    r = asyncio.run(call(app, "POST", path, {**body, "max_tokens": 8, "guided_regex": "[a-z]+"}))
    assert r.status_code == 400, r.text
    err = check_openai_error(r)
    assert err["code"] == "invalid_grammar" and "too many expressions" in err["message"]
    assert "choices" not in r.json()
    # streamed: the output so far, then an in-band error event, then [DONE]; no finish_reason
    r = asyncio.run(call(app, "POST", path, {**body, "max_tokens": 8, "guided_regex": "[a-z]+",
                                             "stream": True}))
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "invalid_grammar" and "too many expressions" in error["message"]
    finishes = [c.get("finish_reason") for e in events[:-2] for c in json.loads(e)["choices"]]
    assert set(finishes) <= {None}
