"""One HTTP request with a `traceparent` header: the front end, the engine and the output actor
(three processes) all put their spans into that one trace, and the verify step that finished the
request carries its `spec.finish` event (docs/contracts.md, *Traces*)."""

from __future__ import annotations

import glob
import os
import time

import httpx
import pytest
from support.serve_helpers import ROOT, running_app

from pipeline.tracing.trace_file import read_spans

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def spans_of_trace(pattern: str, trace_id: str, want: set[str], timeout: float = 20.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in read_spans(sorted(glob.glob(pattern))) if s.trace_id == trace_id]
        if want <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def test_an_http_traceparent_joins_front_end_engine_and_output_actor_in_one_trace(
    ray_cluster, tmp_path
):
    pattern = str(tmp_path / "spans-*.jsonl")
    tracing = {"exporter": "file", "file": str(tmp_path / "spans-{pid}.jsonl"), "batch": False,
               "sample_ratio": 1.0}
    app = {"config": os.path.join(ROOT, "configs", "tiny.yaml"),
           "overrides": {"tracing": tracing}}
    with running_app(app, name="specrelay-traced") as base:
        r = httpx.post(f"{base}/v1/completions", headers={"traceparent": TRACEPARENT}, json={
            "model": "tiny", "prompt": "hello there", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        spans = spans_of_trace(pattern, TRACE_ID,
                               {"POST /v1/completions", "spec.engine.request", "spec.request"})

    by_name = {s.name: s for s in spans}
    server = by_name["POST /v1/completions"]
    assert server.parent_span_id == "00f067aa0ba902b7"  # the client's span
    request = by_name["spec.request"]
    assert request.parent_span_id == server.span_id  # docs/contracts.md, *Traces*: the server span
    assert by_name["spec.engine.request"].parent_span_id == server.span_id
    assert request.attributes["finish.reason"] == "length"
    assert request.attributes["request.completion_tokens"] == 6
    services = {s.resource.get("service.name") for s in spans}
    assert {"specrelay-frontend", "specrelay-engine", "specrelay-output"} <= services
    files = {f for f in glob.glob(pattern)
             if any(s.trace_id == TRACE_ID for s in read_spans([f]))}
    assert len(files) >= 3  # one file per process ({pid} in the path)

    # The step that finished the request: its span links the request span and holds the event.
    steps = [s for s in read_spans(sorted(glob.glob(pattern))) if s.name == "spec.verify_step"
             and any(e.name == "spec.finish" and e.attributes["request.id"] == request.attributes[
                 "request.id"] for e in s.events)]
    assert len(steps) == 1
    assert steps[0].attributes["spec.step"] == request.attributes["finish.step"]
    assert any(link.span_id == request.span_id for link in steps[0].links)
