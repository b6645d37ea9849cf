"""`specrelay serve` as a user runs it: its own local Ray, Serve on loopback, the API key."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from support.serve_helpers import ROOT, serve_process

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def test_specrelay_serve_binds_loopback_and_requires_the_key(tmp_path):
    env = {"RAY_AUTH_MODE": "token", "SPECRELAY_API_KEY": "from-env"}
    with serve_process(os.path.join(ROOT, "configs", "tiny.yaml"), tmp_path, env,
                       ready_timeout=150) as run:
        base = run.base
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401
        ok = {"Authorization": "Bearer from-env"}
        r = httpx.post(f"{base}/v1/completions", headers=ok, timeout=60,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 4,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    assert run.rc == 0, run.log_path.read_text()[-3000:]
    # The port is released once the server stopped.
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health", timeout=2)


def test_specrelay_serve_replicas_flag_runs_two_engines_behind_one_ingress(tmp_path):
    with serve_process(os.path.join(ROOT, "configs", "tiny.yaml"), tmp_path,
                       {"RAY_AUTH_MODE": "token"}, ["--replicas", "2", "--routing", "pow2"],
                       ready_timeout=180) as run:
        for _ in range(4):
            r = httpx.post(f"{run.base}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
        text = httpx.get(f"{run.base}/metrics", timeout=30).text
        healthy = [line for line in text.splitlines()
                   if line.startswith("specrelay_engine_healthy{")]
        assert len(healthy) == 2 and all('replica="' in h and h.endswith(" 1.0")
                                          for h in healthy), healthy
        steps = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("specrelay_engine_steps_total{")]
        assert len(steps) == 2 and sum(steps) >= 4
    assert run.rc == 0, run.log_path.read_text()[-3000:]


def test_sigterm_to_the_whole_process_group_exits_promptly(tmp_path):
    """systemd's default KillMode and `timeout` signal the whole group: the local Ray's GCS and
    raylet die with the server, which then must not wait a minute for them."""
    with serve_process(os.path.join(ROOT, "configs", "tiny.yaml"), tmp_path,
                       {"RAY_AUTH_MODE": "token"}, ready_timeout=150) as run:
        t0 = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGTERM)
        rc = run.proc.wait(timeout=60)
        took = time.monotonic() - t0
    assert rc == 0, run.log_path.read_text()[-3000:]
    assert took < 15, (took, run.log_path.read_text()[-3000:])
