"""`specrelay serve` as a user runs it: its own local Ray, Serve on loopback, the API key."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from serve_helpers import ROOT, free_port, wait_healthy

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def test_specrelay_serve_binds_loopback_and_requires_the_key(tmp_path):
    port = free_port()
    env = dict(os.environ, RAY_AUTH_MODE="token", SPECRELAY_API_KEY="from-env")
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "actors.cli", "serve", "--config",
           os.path.join(ROOT, "configs", "tiny.yaml"), "--port", str(port), "--num-cpus", "4"]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, timeout=150)
        deadline = time.monotonic() + 30
        while f"serving on http://127.0.0.1:{port}/v1" not in log_path.read_text():
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401
        ok = {"Authorization": "Bearer from-env"}
        r = httpx.post(f"{base}/v1/completions", headers=ok, timeout=60,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 4,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            rc = None
        with contextlib.suppress(ProcessLookupError):  # anything left of our own session
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, log_path.read_text()[-3000:]
    # The port is released once the server stopped.
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health", timeout=2)
