"""`ray job submit` of scripts/batch_generate.py against a `ray start --head` on loopback.

The head runs with `--block` in its own session and is stopped by signalling that process (and
its process group): plain `ray stop` would stop every Ray on the machine, other users' too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest
from serve_helpers import ROOT, free_port

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

BIN = os.path.dirname(sys.executable)
RAY = os.path.join(BIN, "ray")


def ray_env() -> dict[str, str]:
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    return env


@contextlib.contextmanager
def ray_head(tmp: str) -> Iterator[int]:
    """`ray start --head` on 127.0.0.1 with non-default ports; yields the dashboard port."""
    dash = free_port()
    worker_lo = random.randrange(31000, 39000, 100)
    cmd = [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           f"--port={free_port()}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--ray-client-server-port={free_port()}",
           f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}",
           f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
           f"--runtime-env-agent-port={free_port()}", f"--min-worker-port={worker_lo}",
           f"--max-worker-port={worker_lo + 99}", "--num-cpus=4", f"--temp-dir={tmp}",
           "--disable-usage-stats"]
    log_path = os.path.join(tmp, "ray_start.log")

    def log_tail() -> str:
        with open(log_path) as f:
            return f.read()[-3000:]

    with open(log_path, "w") as log:
        head = subprocess.Popen(cmd, env=ray_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert head.poll() is None, log_tail()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{dash}/api/version", timeout=2).status_code \
                        in (200, 401):
                    break
            assert time.monotonic() < deadline, log_tail()
            time.sleep(1)
        yield dash
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
        with contextlib.suppress(ProcessLookupError):  # leftovers of our own session only
            os.killpg(head.pid, signal.SIGKILL)


def test_ray_job_submit_batch_generate_writes_results():
    prompts = [
        {"id": "p0", "prompt": "The quick brown fox", "max_tokens": 6, "ignore_eos": True},
        {"id": "p1", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
        "a plain string prompt",
        {"id": "p3", "prompt": "hello", "temperature": -1},  # invalid: reported, not fatal
    ]
    with tempfile.TemporaryDirectory(prefix="srjob", dir="/tmp") as tmp:
        inp, out = os.path.join(tmp, "prompts.jsonl"), os.path.join(tmp, "results.jsonl")
        with open(inp, "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in prompts)
        with ray_head(tmp) as dash:
            proc = subprocess.run(
                [RAY, "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--",
                 sys.executable, os.path.join(ROOT, "scripts", "batch_generate.py"),
                 "--input", inp, "--output", out, "--config",
                 os.path.join(ROOT, "configs", "tiny.yaml"), "--max-tokens", "5",
                 "--progress-every", "0.5"],
                env=ray_env(), capture_output=True, text=True, timeout=240, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "succeeded" in proc.stdout + proc.stderr
        assert "progress: 4/4 prompts, 1 errors" in proc.stdout
        with open(out) as f:
            results = [json.loads(line) for line in f]
    assert [r["id"] for r in results] == ["p0", "p1", 2, "p3"]
    assert [r["index"] for r in results] == [0, 1, 2, 3]
    for r, n in zip(results[:2], (6, 5)):  # ignore_eos: exactly max_tokens
        assert (r["finish_reason"], r["completion_tokens"], r["matched_stop"]) == (
            "length", n, None)
    for r in results[:3]:
        assert r["error"] is None and 1 <= r["completion_tokens"] <= 6
        assert r["spec_stats"]["verify_ct"] >= 1
        assert sum(r["spec_stats"]["acceptance_histogram"]) == r["spec_stats"]["verify_ct"]
    assert "temperature" in results[3]["error"]
