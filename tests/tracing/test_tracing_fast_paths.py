"""The output path's cheaper ways to build spans record what the plain ways would: the traceparent
parse equals OpenTelemetry's propagator, and a step span's ids, links and per-request arrays
equal the straightforward computation whatever the batches do between steps (the last step's ids
and links are reused only while nothing changed)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pipeline import SamplingParams
from pipeline.output.processor import OutputProcessor
from pipeline.output.spans import TracedOutputProcessor
from pipeline.protocol import ProtocolError, VerifyStep, encode
from pipeline.tracing.otel import context_from_traceparent, make_provider, resolve_config
from pipeline.tracing.recorder import SpanRecorder
from pipeline.tracing.schema import retained_from_step

HEX = "0123456789abcdef"


def hex_text(n: int) -> st.SearchStrategy[str]:
    # zeros often: all-zero ids are invalid and must stay so
    return st.one_of(st.just("0" * n), st.text(HEX, min_size=n, max_size=n))


TRACEPARENTS = st.one_of(
    st.text(max_size=70),
    st.builds("{}-{}-{}-{}{}".format, st.sampled_from(["00", "01", "ff", "0g"]), hex_text(32),
              hex_text(16), st.sampled_from(["00", "01", "02", "ff", "f"]),
              st.sampled_from(["", "-x", " ", "\t", "-"])),
    st.builds(" {}".format, st.builds("00-{}-{}-01".format, hex_text(32), hex_text(16))),
)


def parent_of(ctx: context_api.Context) -> trace.SpanContext:
    return trace.get_current_span(ctx).get_span_context()


@given(TRACEPARENTS)
@example("00-" + "a" * 32 + "-" + "b" * 16 + "-01")  # the form specrelay writes
@example("00-" + "a" * 32 + "-" + "b" * 16 + "-01-x")  # version 00 allows nothing after
@example("01-" + "a" * 32 + "-" + "b" * 16 + "-01-x")  # a later version may add fields
@example("00-" + "A" * 32 + "-" + "b" * 16 + "-01")  # upper case: not valid
@example("00-" + "a" * 32 + "-" + "0" * 16 + "-01")  # a zero id: not valid
@example("00-" + "a" * 32 + "-" + "b" * 16 + "-01 ")  # blanks around: valid
@settings(max_examples=400, deadline=None)
def test_traceparent_parse_equals_the_propagator(tp):
    want = TraceContextTextMapPropagator().extract({"traceparent": tp}, context_api.Context())
    assert parent_of(context_from_traceparent(tp)) == parent_of(want)


def recorders() -> list[tuple[SpanRecorder, bool]]:
    """Recorders over `make_provider`'s sampler (the parent's flag decides) and over samplers
    whose decision the recorder must ask for."""
    made = [SpanRecorder(make_provider(resolve_config("t", {"sample_ratio": r}, environ={}))
                         .get_tracer("t")) for r in (0.0, 0.5, 1.0)]
    asked = [SpanRecorder(TracerProvider(sampler=s).get_tracer("t"))
             for s in (ALWAYS_ON, ParentBased(ALWAYS_ON, remote_parent_sampled=ALWAYS_OFF))]
    return [(r, True) for r in made] + [(r, False) for r in asked]


RECORDERS = recorders()
REMOTE = st.builds("00-{}-{}-{}".format, hex_text(32), hex_text(16), st.sampled_from(["00", "01"]))


@given(st.one_of(REMOTE, TRACEPARENTS))
@settings(max_examples=200, deadline=None)
def test_start_child_decides_as_start_with_the_parsed_context(tp):
    for recorder, follows in RECORDERS:
        assert recorder._follows_remote is follows
        fast = recorder.start_child("s", tp, SpanKind.CONSUMER)
        plain = recorder.start("s", context_from_traceparent(tp), SpanKind.CONSUMER)
        assert (fast.name, fast.kind, fast.parent) == (plain.name, plain.kind, plain.parent)
        if plain.parent is not None:  # a root span's decision follows its own random trace id
            a, b = fast.context, plain.context
            assert (a.trace_id, a.trace_flags, a.trace_state, a.is_remote, fast.recording) == (
                b.trace_id, b.trace_flags, b.trace_state, b.is_remote, plain.recording)


# A program: each op adds a request (its span recorded or not), aborts one, or runs a step over
# some requests in some order (unknown and finished ones included, so some rows are dropped).
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 7)),
        st.tuples(st.just("step"), st.lists(st.integers(0, 7), max_size=8, unique=True),
                  st.booleans(), st.integers(0, 2)),
    ),
    max_size=25,
)
UNSAMPLED_PARENT = "00-" + "1" * 32 + "-" + "2" * 16 + "-00"


@given(OPS)
# the same running request beside a different unknown one (other ids, same running set)
@example([("add", 0, True), ("step", [0, 1], False, 0), ("step", [0, 2], False, 0)])
# the same requests in another order
@example([("add", 0, True), ("add", 1, True), ("step", [0, 1], False, 0),
          ("step", [1, 0], False, 0)])
# an id reused by a request whose span is not recorded: same ids, new request, no link
@example([("add", 0, True), ("step", [0], False, 0), ("step", [0], False, 0), ("abort", 0),
          ("add", 0, False), ("step", [0], False, 0), ("step", [0], False, 0)])
@settings(max_examples=150, deadline=None)
def test_step_spans_equal_the_plain_computation(ops):
    exporter = InMemorySpanExporter()
    provider = make_provider(resolve_config("t", {"batch": False}, environ={}), exporter)
    proc = TracedOutputProcessor(OutputProcessor(None, [2]), provider.get_tracer("t"))
    step, expected = 0, []
    for op in ops:
        if op[0] == "add":
            rid = f"r{op[1]}"
            if proc.inner.get_state(rid) is not None:  # running; a finished id may come back
                continue
            proc.add_request(rid, [1], SamplingParams(max_new_tokens=6),
                             None if op[2] else UNSAMPLED_PARENT)
        elif op[0] == "abort":
            proc.abort(f"r{op[1]}")
        else:
            rids = [f"r{i}" for i in op[1]]
            if not rids:
                continue
            # links: the requests whose span is recorded and running, in step order
            tps = [proc.request_traceparent(r) for r in rids]
            links = [int(tp[36:52], 16) for tp in tps if tp is not None and tp.endswith("-01")]
            lengths = [1 + (i + op[3]) % 3 for i in range(len(rids))]
            windows = [[2 if op[2] and i == 0 else 7] * n for i, n in enumerate(lengths)]
            drafted = [n - 1 + i % 2 for i, n in enumerate(lengths)]
            outs = {o.rid: o for o in proc.process(encode(VerifyStep(step, rids, windows,
                                                                     drafted)))}
            retained = [len(outs[r].token_ids) if r in outs else 0 for r in rids]
            expected.append((step, tuple(rids), links, tuple(drafted),
                             tuple(n - 1 for n in lengths), retained, len(outs) != len(rids)))
            step += 1
    spans = [s for s in exporter.get_finished_spans() if s.name == "spec.verify_step"]
    got = []
    for s in spans:
        a = s.attributes
        assert a["spec.batch_size"] == len(a["spec.request.ids"])
        assert a["spec.drafted_tokens"] == sum(a["spec.request.drafted"])
        assert a["spec.accepted_tokens"] == sum(a["spec.request.accepted"])
        assert all(type(a[k]) is tuple for k in a if k.startswith("spec.request."))
        # what each kept: written out only on a step some rows were dropped from
        got.append((a["spec.step"], a["spec.request.ids"],
                    [ln.context.span_id for ln in s.links], a["spec.request.drafted"],
                    a["spec.request.accepted"], retained_from_step(a, s.events),
                    "spec.request.retained" in a))
    assert got == expected


def test_step_rows_are_the_states_of_the_last_applied_step():
    """What the step span's batch cache compares: one state per row, in message order, None for
    an unknown request; a refused step leaves it as it was."""
    proc = OutputProcessor(None, [2])
    for rid in ("a", "b"):
        proc.add_request(rid, [1], SamplingParams(max_new_tokens=6))
    proc.process(encode(VerifyStep(0, ["b", "x", "a"], [[7], [7], [7]], [0, 0, 0])))
    assert proc.step_rows == [proc.get_state("b"), None, proc.get_state("a")]
    rows = proc.step_rows
    proc.add_request("c", [1], SamplingParams(max_new_tokens=6, logprobs=0))
    with pytest.raises(ProtocolError):  # asks for logprobs the step lacks
        proc.process(encode(VerifyStep(1, ["c"], [[7]], [0])))
    assert proc.step_rows is rows
    twin = OutputProcessor(None, [2])
    twin.add_request("a", [1], SamplingParams(max_new_tokens=6))
    assert twin.get_state("a") != proc.get_state("a")  # equal only to itself
