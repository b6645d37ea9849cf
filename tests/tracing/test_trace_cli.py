"""`specrelay trace` over files from the JSON-lines exporter and from a Collector's file exporter."""

from __future__ import annotations

import json

import pytest
from support.trace_scenario import EOS, run_scenario, toks

from pipeline.tracing.cli import main
from pipeline.tracing.trace_file import JsonLinesSpanExporter


@pytest.fixture(scope="module")
def trace_run(smollm2_tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "run.jsonl"
    exporter = JsonLinesSpanExporter(str(path))
    run = run_scenario(smollm2_tokenizer, exporter)
    run.provider.shutdown()
    return run, str(path)


def cli_json(capsys, *argv: str):
    assert main([*argv, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_request_json_reproduces_the_run(trace_run, capsys):
    run, path = trace_run
    for rid, out in run.finals.items():
        rep = cli_json(capsys, path, "--request", rid)
        f = rep["finish"]
        assert f["reason"] == out.finish_reason
        assert f["matched"] == out.matched_stop  # the token id comes back as an int
        assert f["step"] == out.finish_step
        if rid != "abort":
            assert f["len"] == out.finished_len == rep["completion_tokens"]
            assert sum(e["retained"] for e in rep["steps"]) == out.finished_len
        assert rep["verify_ct"] == out.spec_verify_ct
        assert rep["accepted_tokens"] == out.spec_accepted_tokens


def test_request_steps_and_window_position(trace_run, capsys):
    _, path = trace_run
    rep = cli_json(capsys, path, "--request", "len")
    assert rep["steps"] == [
        {"step": 0, "drafted": 0, "accepted": 0, "retained": 1},
        {"step": 1, "drafted": 4, "accepted": 2, "retained": 3},
        {"step": 2, "drafted": 4, "accepted": 3, "retained": 2},
    ]
    assert rep["finish"] == {
        "step": 2,
        "reason": "length",
        "matched": None,
        "len": 6,
        "window_position": 1,
    }
    rep = cli_json(capsys, path, "--request", "hash")
    assert rep["finish"]["matched"] == "###" and rep["finish"]["window_position"] == 2
    # the step after "eos" finished was dropped for it: not one of its steps
    assert [e["step"] for e in cli_json(capsys, path, "--request", "eos")["steps"]] == [0, 1]
    abort = cli_json(capsys, path, "--request", "abort")
    assert abort["finish"]["reason"] == "abort" and abort["completion_tokens"] == 3


def test_step_json_lists_the_requests_it_finished(trace_run, capsys):
    _, path = trace_run
    (rep,) = cli_json(capsys, path, "--step", "1")
    assert (rep["batch_size"], rep["drafted_tokens"], rep["accepted_tokens"]) == (6, 24, 12)
    assert rep["finished"] == [
        {"request": "eos", "reason": "stop", "matched": EOS, "len": 4, "window_position": 2},
        {"request": "hash", "reason": "stop", "matched": "###", "len": 4, "window_position": 2},
    ]
    (rep,) = cli_json(capsys, path, "--step", "0")
    assert rep["finished"] == []


def test_summary_counts_reasons_and_acceptance(trace_run, capsys):
    _, path = trace_run
    s = cli_json(capsys, path)
    assert (s["requests"], s["steps"]) == (6, 3)
    assert s["finish_reasons"] == {"abort": 1, "length": 1, "stop": 4}
    # verify-step entries (drafted > 0, not dropped): step 1 accepted 3,4,2,0,1,2; step 2 3,1,1
    assert s["acceptance_histogram"] == {"0": 1, "1": 3, "2": 2, "3": 2, "4": 1}
    assert (s["drafted_tokens"], s["accepted_tokens"]) == (32, 17)


def test_table_output_names_the_finish(trace_run, capsys, smollm2_tokenizer):
    _, path = trace_run
    assert main([path, "--request", "last"]) == 0
    text = capsys.readouterr().out
    (near,) = toks(smollm2_tokenizer, " near")
    assert f"reason=stop matched=token {near} window_position=1 len=6" in text
    assert main([path, "--step", "2"]) == 0
    text = capsys.readouterr().out
    assert '"world."' in text and "length" in text
    assert main([path]) == 0
    assert "finish reasons: abort=1, length=1, stop=4" in capsys.readouterr().out


def test_file_lines_are_collector_style_otlp_json(trace_run):
    _, path = trace_run
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    assert lines and all(set(doc) == {"resourceSpans"} for doc in lines)
    span = lines[0]["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(span["traceId"]) == 32 and int(span["traceId"], 16) > 0
    assert len(span["spanId"]) == 16 and int(span["spanId"], 16) > 0
    assert isinstance(span["startTimeUnixNano"], str) and int(span["startTimeUnixNano"]) > 0
    assert isinstance(span["kind"], int)
    kv = {a["key"]: a["value"] for a in span["attributes"]}
    assert "request.id" in kv or "spec.step" in kv
    for v in kv.values():
        assert set(v) <= {"stringValue", "intValue", "arrayValue", "doubleValue", "boolValue"}
        if "intValue" in v:
            assert isinstance(v["intValue"], str)


def test_unknown_request_and_step_exit_1(trace_run, capsys):
    _, path = trace_run
    assert main([path, "--request", "nope"]) == 1
    assert main([path, "--step", "99"]) == 1
    assert "no step 99" in capsys.readouterr().err


def test_reads_a_hand_written_collector_line(tmp_path, capsys):
    trace_id, step_sid, req_sid = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174", "1" * 16
    kv = lambda k, v: {"key": k, "value": v}
    req = {
        "traceId": trace_id,
        "spanId": req_sid,
        "name": "spec.request",
        "kind": 1,
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000000500000000",
        "attributes": [
            kv("request.id", {"stringValue": "c1"}),
            kv("request.prompt_tokens", {"intValue": "7"}),
            kv("request.completion_tokens", {"intValue": "2"}),
            kv("finish.reason", {"stringValue": "stop"}),
            kv("finish.matched", {"stringValue": "\n"}),
            kv("finish.matched_kind", {"stringValue": "string"}),
            kv("finish.step", {"intValue": "41"}),
        ],
        "status": {},
    }
    step = {
        "traceId": "0af7651916cd43dd8448eb211c80319c",
        "spanId": step_sid,
        "parentSpanId": "b7ad6b7169203331",
        "name": "spec.verify_step",
        "kind": 5,
        "startTimeUnixNano": 1700000000100000000,
        "endTimeUnixNano": "1700000000200000000",
        "attributes": [
            kv("spec.step", {"intValue": "41"}),
            kv("spec.batch_size", {"intValue": "1"}),
            kv("spec.drafted_tokens", {"intValue": "3"}),
            kv("spec.accepted_tokens", {"intValue": "3"}),
        ],
        "events": [
            {
                "timeUnixNano": "1700000000150000000",
                "name": "spec.finish",
                "attributes": [
                    kv("request.id", {"stringValue": "c1"}),
                    kv("finish.reason", {"stringValue": "stop"}),
                    kv("finish.matched", {"stringValue": "\n"}),
                    kv("finish.matched_kind", {"stringValue": "string"}),
                    kv("finish.len", {"intValue": "2"}),
                    kv("finish.window_position", {"intValue": "1"}),
                ],
            }
        ],
        "links": [{"traceId": trace_id, "spanId": req_sid}],
        "status": {},
    }
    doc = {
        "resourceSpans": [
            {
                "resource": {"attributes": [kv("service.name", {"stringValue": "output"})]},
                "scopeSpans": [{"scope": {"name": "specrelay"}, "spans": [req, step]}],
            }
        ]
    }
    path = tmp_path / "collector.json"
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n\n")
    rep = cli_json(capsys, str(path), "--request", "c1")
    assert rep["prompt_tokens"] == 7
    assert rep["steps"] == [{"step": 41, "drafted": None, "accepted": None, "retained": None}]
    assert rep["finish"] == {
        "step": 41,
        "reason": "stop",
        "matched": "\n",
        "len": 2,
        "window_position": 1,
    }


def test_reads_base64_ids_and_rejects_garbage(tmp_path, capsys):
    span = {
        "traceId": "W47/95gDgQPSabYzgT/GDA==",
        "spanId": "7uGbfsPBsXQ=",
        "name": "spec.request",
        "startTimeUnixNano": "1",
        "endTimeUnixNano": "2",
        "attributes": [{"key": "request.id", "value": {"stringValue": "b"}}],
    }
    good = tmp_path / "b64.jsonl"
    good.write_text(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}) + "\n")
    from pipeline.tracing.trace_file import read_spans

    (rec,) = read_spans([str(good)])
    assert (rec.trace_id, rec.span_id) == ("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174")
    assert cli_json(capsys, str(good))["requests"] == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main([str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_specrelay_cli_dispatches_trace(trace_run, capsys):
    from actors.cli import main as specrelay

    _, path = trace_run
    assert specrelay(["trace", path, "--step", "2", "--format", "json"]) == 0
    (rep,) = json.loads(capsys.readouterr().out)
    assert [f["request"] for f in rep["finished"]] == ["len", "split", "last"]
