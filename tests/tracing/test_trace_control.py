"""Why this k, in traces: the engine step span carries the controller's decision (spec.control.*),
and `specrelay trace` prints a request's timeline (k chosen vs drafts verified vs kept) from the
trace file of a real in-process run (tiny model)."""

from __future__ import annotations

import asyncio
import json

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline.config import load_config
from pipeline.engine.core import EngineCore
from pipeline.engine.local import LocalStages, build_local_engine, collect
from pipeline.engine.spec.record import PLANS
from pipeline.models.runners import tiny_tokenizer
from pipeline.output.processor import OutputProcessor
from pipeline.output.spans import TracedOutputProcessor
from pipeline.params import SamplingParams
from pipeline.tracing.cli import main
from pipeline.tracing.trace_file import JsonLinesSpanExporter

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = {"r0": [5, 6, 7, 8, 9, 10, 5, 6, 7], "r1": [3] * 20, "r2": [77, 78, 77, 78, 77]}


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """Three requests through the adaptive engine, every span kept in memory and in a file."""
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(str(path))))
    tracer = provider.get_tracer("test")
    config = load_config("configs/tiny.yaml", {"overlap": False, "speculation": "adaptive"})
    local = build_local_engine(config).stages
    output = TracedOutputProcessor(OutputProcessor(tiny_tokenizer(), [2]), tracer=tracer)
    core = EngineCore(config, LocalStages(local.proposer, local.verifier, output), 256, tracer)
    requests = [(rid, p, SamplingParams(max_new_tokens=30, ignore_eos=True))
                for rid, p in PROMPTS.items()]
    results = asyncio.run(collect(core, requests))
    provider.shutdown()
    return memory.get_finished_spans(), str(path), results, core.stats


def test_each_engine_step_span_says_why_each_request_got_its_k(traced_run):
    spans, _, _, _ = traced_run
    engine = {s.context.span_id: s for s in spans if s.name == "spec.engine_step"}
    verify = {s.parent.span_id: s for s in spans if s.name == "spec.verify_step"}
    plans = []
    for sid, step in engine.items():
        a = step.attributes
        ids = a["spec.request.ids"]
        assert ids == verify[sid].attributes["spec.request.ids"]  # one message order
        plan = a.get("spec.control.plan")  # none in a step of prefills only
        assert plan in PLANS or (plan is None and a["spec.prefills"] == len(ids))
        plans.append(plan)
        assert len(a["spec.control.k"]) == len(a["spec.control.cap"]) == len(ids)
        prefills = a["spec.prefills"]
        assert a["spec.control.why"][:prefills] == ("prefill",) * prefills
        drafted = verify[sid].attributes["spec.request.drafted"]
        for k, cap, d in zip(a["spec.control.k"], a["spec.control.cap"], drafted):
            assert 0 <= k <= cap and d <= k  # the verifier never checks more than was asked
        if plan == "rate":
            assert "spec.control.floor" in a and "spec.control.cost.base_s" in a
            for k, gain, nxt in zip(a["spec.control.k"][prefills:],
                                    a["spec.control.gain"][prefills:],
                                    a["spec.control.next_gain"][prefills:]):
                # S_m never grows with m: one more draft gains at most the drafts' mean
                assert nxt <= (gain / k if k else 1.0) + 1e-12
    # nothing is measured at the first decode, then the rows are explored, then planned
    assert plans[:2] == [None, "off"] and "rate" in plans


def test_trace_cli_prints_a_requests_timeline_of_k_chosen_vs_verified_vs_kept(traced_run, capsys):
    _, path, results, _ = traced_run
    assert main([path, "--request", "r1", "--format", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    control = {c["step"]: c for c in rep["control"]}
    assert [e["step"] for e in rep["steps"]] == sorted(control)  # one decision per step
    assert control[rep["steps"][0]["step"]]["why"] == "prefill"
    for e in rep["steps"]:
        assert e["drafted"] <= control[e["step"]]["k"]
    assert sum(e["retained"] for e in rep["steps"]) == len(results["r1"].token_ids) == 30
    assert rep["finish"]["reason"] == "length"
    assert main([path, "--request", "r1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["step", "k", "cap", "why", "drafted", "accepted", "retained",
                                "finish"]
    last = rep["steps"][-1]
    assert lines[1 + len(rep["steps"])].split()[-1] == "length"
    assert lines[1 + len(rep["steps"])].split()[0] == str(last["step"])


def test_trace_cli_summary_matches_the_engines_own_counts(traced_run, capsys):
    _, path, _, stats = traced_run
    assert main([path, "--format", "json"]) == 0
    s = json.loads(capsys.readouterr().out)
    by_pos = s["acceptance_by_position"]
    assert by_pos[0]["drafted"] == stats.drafts  # every draft reaches position 0
    assert [p["accepted"] for p in by_pos][:len(stats.accepted_per_pos)] == stats.accepted_per_pos
    assert s["request_steps_without_drafts"] == stats.verify_steps - stats.drafts
    assert s["finishes_by_step"] and sum(
        c.get("length", 0) for c in s["finishes_by_step"].values()) == 3
    assert main([path]) == 0
    out = capsys.readouterr().out
    assert "acceptance by draft position" in out and "finishes by step:" in out
