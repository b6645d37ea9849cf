"""TracedOutputProcessor over the real OutputProcessor: spans, links and spec.finish events agree with
the RequestOutputs (docs/contracts.md, *Traces*)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.trace_scenario import EOS, run_scenario, toks

from pipeline import SamplingParams
from pipeline.output.processor import OutputProcessor
from pipeline.output.spans import TracedOutputProcessor
from pipeline.protocol import ProtocolError, VerifyStep, encode
from pipeline.tracing.otel import make_provider, resolve_config, traceparent_of
from pipeline.tracing.schema import matched_from_attributes, retained_from_step


@pytest.fixture(scope="module")
def traced(smollm2_tokenizer):
    exporter = InMemorySpanExporter()
    run = run_scenario(smollm2_tokenizer, exporter)
    spans = exporter.get_finished_spans()
    return run, spans


def by_name(spans, name):
    return [s for s in spans if s.name == name]


def test_finish_outputs_of_the_scenario(traced, smollm2_tokenizer):
    """The scenario's finishes, as the output processor reports them (the ground truth below)."""
    run, _ = traced
    (near,) = toks(smollm2_tokenizer, " near")
    got = {
        rid: (o.finish_reason, o.matched_stop, o.finished_len, o.finish_step)
        for rid, o in run.finals.items()
    }
    assert got == {
        "eos": ("stop", EOS, 4, 1),
        "hash": ("stop", "###", 4, 1),
        "split": ("stop", "world.", 3, 2),
        "len": ("length", None, 6, 2),
        "last": ("stop", near, 6, 2),
        "abort": ("abort", None, got["abort"][2], None),
    }


def test_every_finished_request_has_exactly_one_finish_event_on_its_step(traced):
    run, spans = traced
    steps = by_name(spans, "spec.verify_step")
    assert sorted(s.attributes["spec.step"] for s in steps) == [0, 1, 2]
    events = [(s, e) for s in steps for e in s.events if e.name == "spec.finish"]
    for rid, out in run.finals.items():
        mine = [(s, e) for s, e in events if e.attributes["request.id"] == rid]
        if out.finish_reason == "abort":
            assert mine == []
            continue
        assert len(mine) == 1, rid
        span, ev = mine[0]
        assert span.attributes["spec.step"] == out.finish_step
        assert ev.attributes["finish.reason"] == out.finish_reason
        assert matched_from_attributes(dict(ev.attributes)) == out.matched_stop
        assert ev.attributes["finish.len"] == out.finished_len
    assert len(events) == 5


def test_finish_window_position_is_index_inside_the_window(traced):
    _, spans = traced
    pos = {
        e.attributes["request.id"]: e.attributes["finish.window_position"]
        for s in by_name(spans, "spec.verify_step")
        for e in s.events
    }
    # eos: [world . EOS The] -> 2; hash: [world . ### The end] -> 2; split: [. The] -> 0;
    # len: positions 4..7, cap at 5 -> 1; last: [is near] -> 1
    assert pos == {"eos": 2, "hash": 2, "split": 0, "len": 1, "last": 1}


def test_matched_stop_attribute_encoding(traced, smollm2_tokenizer):
    _, spans = traced
    (near,) = toks(smollm2_tokenizer, " near")
    ev = {
        e.attributes["request.id"]: dict(e.attributes)
        for s in by_name(spans, "spec.verify_step")
        for e in s.events
    }
    assert (ev["eos"]["finish.matched"], ev["eos"]["finish.matched_kind"]) == ("2", "token_id")
    assert (ev["last"]["finish.matched"], ev["last"]["finish.matched_kind"]) == (
        str(near),
        "token_id",
    )
    assert (ev["hash"]["finish.matched"], ev["hash"]["finish.matched_kind"]) == ("###", "string")
    assert "finish.matched" not in ev["len"] and "finish.matched_kind" not in ev["len"]


def test_step_spans_link_every_live_request_of_the_step(traced):
    run, spans = traced
    req_span = {s.attributes["request.id"]: s for s in by_name(spans, "spec.request")}
    assert set(req_span) == {"eos", "hash", "len", "split", "abort", "last"}
    for s in by_name(spans, "spec.verify_step"):
        linked = {ln.context.span_id for ln in s.links}
        step = run.steps[s.attributes["spec.step"]]
        live = [rid for rid in step.rids if not (step.step == 2 and rid == "eos")]
        assert linked == {req_span[rid].context.span_id for rid in live}
    # ...and from a request span, its steps are found through those links
    steps_of = defaultdict(set)
    by_span_id = {s.context.span_id: s.attributes["request.id"] for s in req_span.values()}
    for s in by_name(spans, "spec.verify_step"):
        for ln in s.links:
            steps_of[by_span_id[ln.context.span_id]].add(s.attributes["spec.step"])
    assert dict(steps_of) == {
        "eos": {0, 1},
        "hash": {0, 1},
        "len": {0, 1, 2},
        "split": {0, 1, 2},
        "abort": {0, 1},
        "last": {0, 1, 2},
    }


def test_step_span_attributes_carry_raw_acceptance_and_per_request_arrays(traced):
    _, spans = traced
    step = {
        s.attributes["spec.step"]: dict(s.attributes) for s in by_name(spans, "spec.verify_step")
    }
    events = {s.attributes["spec.step"]: s.events for s in by_name(spans, "spec.verify_step")}
    assert step[0]["spec.batch_size"] == 6
    assert (step[0]["spec.drafted_tokens"], step[0]["spec.accepted_tokens"]) == (0, 0)
    # step 1 windows 4,5,3,1,2,3 of 4 drafted each: raw accepted = 3+4+2+0+1+2 (before truncation)
    assert (step[1]["spec.drafted_tokens"], step[1]["spec.accepted_tokens"]) == (24, 12)
    assert step[1]["spec.request.ids"] == ("eos", "hash", "len", "split", "abort", "last")
    assert step[1]["spec.request.accepted"] == (3, 4, 2, 0, 1, 2)
    assert retained_from_step(step[1], events[1]) == [3, 3, 3, 1, 2, 3]
    assert "spec.request.retained" not in step[1]  # finishes only: derived from their events
    assert (step[2]["spec.drafted_tokens"], step[2]["spec.accepted_tokens"]) == (8, 5)
    assert step[2]["spec.request.drafted"] == (0, 4, 3, 1)
    assert step[2]["spec.request.retained"] == (0, 2, 1, 2)  # eos dropped; len capped at 2
    assert retained_from_step(step[2], events[2]) == [0, 2, 1, 2]


def test_request_span_end_attributes_match_the_final_output(traced):
    run, spans = traced
    for s in by_name(spans, "spec.request"):
        rid = s.attributes["request.id"]
        out = run.finals[rid]
        a = dict(s.attributes)
        assert a["finish.reason"] == out.finish_reason
        assert a["spec.verify_ct"] == out.spec_verify_ct
        assert a["spec.accepted_tokens"] == out.spec_accepted_tokens
        assert matched_from_attributes(a) == out.matched_stop
        if rid == "abort":
            assert a["request.completion_tokens"] == 3  # prefill + step 1's two tokens
            assert "finish.step" not in a
        else:
            assert a["request.completion_tokens"] == out.finished_len
            assert a["finish.step"] == out.finish_step
            assert len(run.tokens[rid]) == out.finished_len
    prompt = {
        s.attributes["request.id"]: s.attributes["request.prompt_tokens"]
        for s in spans
        if s.name == "spec.request"
    }
    assert prompt["len"] == 1 and prompt["eos"] == 3


def test_traced_outputs_equal_untraced_outputs(traced, smollm2_tokenizer):
    """Tracing changes nothing the client sees (ratio 0 -> no spans at all)."""
    run, _ = traced
    exporter = InMemorySpanExporter()
    plain = run_scenario(smollm2_tokenizer, exporter, ratio=0.0)
    assert plain.finals == run.finals and plain.tokens == run.tokens
    assert exporter.get_finished_spans() == ()


def test_http_traceparent_becomes_parent_of_request_span(smollm2_tokenizer):
    exporter = InMemorySpanExporter()
    # The "HTTP server" lives in its own provider, as if in the front-end process.
    http = TracerProvider().get_tracer("http").start_span("POST /v1/completions")
    tp = traceparent_of(http)
    provider = make_provider(resolve_config("t", {"batch": False}, environ={}), exporter)
    proc = TracedOutputProcessor(OutputProcessor(smollm2_tokenizer), provider.get_tracer("t"))
    proc.add_request("r", [1, 2], SamplingParams(max_new_tokens=1), traceparent=tp)
    assert proc.request_traceparent("r").split("-")[1] == f"{http.get_span_context().trace_id:032x}"
    proc.process(encode(VerifyStep(0, ["r"], [[5]], [0])))
    (req,) = by_name(exporter.get_finished_spans(), "spec.request")
    assert req.context.trace_id == http.get_span_context().trace_id
    assert req.parent.span_id == http.get_span_context().span_id and req.parent.is_remote


def test_verifier_traceparent_becomes_parent_of_step_span(smollm2_tokenizer):
    exporter = InMemorySpanExporter()
    verifier = TracerProvider().get_tracer("verifier").start_span("verify")
    provider = make_provider(resolve_config("t", {"batch": False}, environ={}), exporter)
    proc = TracedOutputProcessor(OutputProcessor(smollm2_tokenizer), provider.get_tracer("t"))
    proc.add_request("r", [1], SamplingParams(max_new_tokens=4))
    step = VerifyStep(0, ["r"], [[5]], [0], traceparent=traceparent_of(verifier))
    proc.process(encode(step))
    (s,) = by_name(exporter.get_finished_spans(), "spec.verify_step")
    assert s.context.trace_id == verifier.get_span_context().trace_id
    assert s.parent.span_id == verifier.get_span_context().span_id
    assert s.kind == trace.SpanKind.CONSUMER


def test_unsampled_verifier_parent_records_no_step_span(smollm2_tokenizer):
    exporter = InMemorySpanExporter()
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"  # flags 00: not sampled
    provider = make_provider(resolve_config("t", {"batch": False}, environ={}), exporter)
    proc = TracedOutputProcessor(OutputProcessor(smollm2_tokenizer), provider.get_tracer("t"))
    proc.add_request("r", [1], SamplingParams(max_new_tokens=1))
    outs = proc.process(encode(VerifyStep(0, ["r"], [[5]], [0], traceparent=tp)))
    assert outs[0].finished and outs[0].finish_reason == "length"
    names = [s.name for s in exporter.get_finished_spans()]
    assert names == ["spec.request"]  # the request's own trace is still recorded and ended


def test_step_rejected_by_inner_is_an_error_span_and_changes_nothing(smollm2_tokenizer):
    exporter = InMemorySpanExporter()
    provider = make_provider(resolve_config("t", {"batch": False}, environ={}), exporter)
    proc = TracedOutputProcessor(OutputProcessor(smollm2_tokenizer), provider.get_tracer("t"))
    proc.add_request("r", [1], SamplingParams(max_new_tokens=3, logprobs=0))
    with pytest.raises(ProtocolError, match="logprobs"):  # the step carries no logprobs
        proc.process(encode(VerifyStep(0, ["r"], [[5]], [0])))
    proc.process(encode(VerifyStep(0, ["r"], [[5]], [0], logprobs=[[-0.5]])))
    outs = proc.process(encode(VerifyStep(1, ["r"], [[6, 7]], [2], logprobs=[[-1.0, -2.0]])))
    assert outs[-1].finished_len == 3
    spans = exporter.get_finished_spans()
    failed, ok0, _ = by_name(spans, "spec.verify_step")
    assert failed.status.status_code == trace.StatusCode.ERROR
    assert [e.name for e in failed.events] == ["exception"]
    assert ok0.status.status_code == trace.StatusCode.UNSET
    (req,) = by_name(spans, "spec.request")
    assert req.attributes["request.completion_tokens"] == 3  # the failed step counted nothing


def test_a_non_sdk_tracer_records_nothing_and_changes_no_output(smollm2_tokenizer):
    proc = TracedOutputProcessor(OutputProcessor(smollm2_tokenizer), trace.NoOpTracer())
    proc.add_request("r", [1], SamplingParams(max_new_tokens=2), traceparent=None)
    assert proc.request_traceparent("r") is None
    outs = proc.process(encode(VerifyStep(0, ["r"], [[5, 6]], [1])))
    assert (outs[0].token_ids, outs[0].finish_reason, outs[0].finished_len) == ([5, 6], "length", 2)
    assert proc.num_requests == 0  # read through to the wrapped processor


def test_unsampled_request_is_not_linked_but_its_step_is_recorded(smollm2_tokenizer):
    exporter = InMemorySpanExporter()
    provider = make_provider(resolve_config("t", {"batch": False}, environ={}), exporter)
    proc = TracedOutputProcessor(OutputProcessor(smollm2_tokenizer), provider.get_tracer("t"))
    unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    proc.add_request("quiet", [1], SamplingParams(max_new_tokens=1), traceparent=unsampled)
    proc.add_request("loud", [1], SamplingParams(max_new_tokens=1))
    assert proc.request_traceparent("quiet").endswith("-00")  # passed on unsampled
    proc.process(encode(VerifyStep(0, ["quiet", "loud"], [[5], [6]], [0, 0])))
    spans = exporter.get_finished_spans()
    (req,) = by_name(spans, "spec.request")
    (step,) = by_name(spans, "spec.verify_step")
    assert req.attributes["request.id"] == "loud"
    assert [ln.context.span_id for ln in step.links] == [req.context.span_id]
    assert sorted(e.attributes["request.id"] for e in step.events) == ["loud", "quiet"]


def test_a_large_step_links_every_request():
    """No SDK span limit (128 links / events by default) cuts a big batch short."""
    exporter = InMemorySpanExporter()
    provider = make_provider(resolve_config("t", {"batch": False}, environ={}), exporter)
    proc = TracedOutputProcessor(OutputProcessor(None), provider.get_tracer("t"))
    rids = [f"r{i}" for i in range(300)]
    for rid in rids:
        proc.add_request(rid, [1], SamplingParams(max_new_tokens=2))
    proc.process(encode(VerifyStep(0, rids, [[7, 8]] * 300, [1] * 300)))
    (step,) = by_name(exporter.get_finished_spans(), "spec.verify_step")
    assert len(step.links) == 300 and len(step.events) == 300
    assert retained_from_step(step.attributes, step.events) == [2] * 300
    assert {e.attributes["finish.window_position"] for e in step.events} == {1}
