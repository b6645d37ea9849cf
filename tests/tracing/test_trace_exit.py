"""Nothing traced is lost at exit: N requests through `specrelay generate`, scripts/batch_generate.py
and a SIGTERM'd `specrelay serve`, each with the file exporter, leave all N `spec.request` spans
and a `spec.verify_step` span for every engine step in the file (every process flushes its span
processor before it ends: the engine's shutdown flushes the output actor and itself, the Serve
replica flushes after the engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.serve_helpers import ROOT, serve_process

from pipeline.tracing.trace_file import read_spans

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
PROMPTS = ["The quick brown fox", "hello", "abc abc abc", "one two three four"]


def traced_env(trace_file: Path) -> dict[str, str]:
    # RAY_ADDRESS=local: a cluster of its own, never one someone started with `ray start`.
    return {**os.environ, "OTEL_TRACES_EXPORTER": "file", "SPECRELAY_TRACE_FILE": str(trace_file),
            "RAY_ADDRESS": "local", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": ROOT}


def check_complete(trace_file: Path, n: int) -> None:
    spans = read_spans([str(trace_file)])
    requests = [s for s in spans if s.name == "spec.request"]
    assert len({s.attributes["request.id"] for s in requests}) == len(requests) == n
    engine_steps = {s.attributes["spec.step"] for s in spans if s.name == "spec.engine_step"}
    verify_steps = {s.attributes["spec.step"] for s in spans if s.name == "spec.verify_step"}
    assert engine_steps and verify_steps == engine_steps


def test_generate_exports_every_span_before_it_exits(tmp_path):
    trace_file = tmp_path / "traces.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "actors.cli", "generate", "--config", CONFIG, "--max-tokens", "9",
         *PROMPTS], cwd=ROOT, env=traced_env(trace_file), capture_output=True, text=True,
        timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    check_complete(trace_file, len(PROMPTS))


def test_batch_generate_exports_every_span_before_it_exits(tmp_path):
    trace_file, inp, out = (tmp_path / "traces.jsonl", tmp_path / "in.jsonl",
                            tmp_path / "out.jsonl")
    inp.write_text("".join(json.dumps({"prompt": p, "max_tokens": 9}) + "\n" for p in PROMPTS))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "batch_generate.py"), "--input", str(inp),
         "--output", str(out), "--config", CONFIG], cwd=ROOT, env=traced_env(trace_file),
        capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "started a local Ray cluster at" in proc.stdout  # it says which cluster it used
    assert len(out.read_text().splitlines()) == len(PROMPTS)
    check_complete(trace_file, len(PROMPTS))


def test_a_sigtermed_serve_exports_every_span_before_it_exits(tmp_path):
    trace_file = tmp_path / "traces.jsonl"
    env = traced_env(trace_file)
    env.pop("RAY_ADDRESS")  # serve starts its own local Ray (serve_process)
    with serve_process(CONFIG, tmp_path, env) as run:
        for prompt in PROMPTS:
            r = httpx.post(f"{run.base}/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 9})
            assert r.status_code == 200, r.text
    assert run.rc == 0, run.log_path.read_text()[-3000:]
    check_complete(trace_file, len(PROMPTS))
    http = [s for s in read_spans([str(trace_file)]) if s.name == "POST /v1/completions"]
    assert len(http) == len(PROMPTS)  # the front end's own server spans too
