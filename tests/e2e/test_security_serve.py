"""`specrelay serve` as a user starts it (its own local Ray): every listening socket of the
deployment's processes is on loopback, and SIGTERM drains: new requests are refused while the
request in flight finishes, then the process exits 0 within the grace period."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
import yaml
from support.serve_helpers import ROOT, serve_process

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
KEY = "scan-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRACE_S = 60  # the 4-choice stream below ends within ~25 s of the SIGTERM on a slow 2-core VM


def listening_sockets(root: psutil.Process) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every LISTEN socket in root's process tree."""
    out = []
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((p.pid, p.name(), c.laddr.ip, c.laddr.port))
    return out


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """`specrelay serve` with a slow-to-finish tiny config (long streams to drain)."""
    tmp = tmp_path_factory.mktemp("serve")
    with open(os.path.join(ROOT, "configs", "tiny.yaml")) as f:
        config = yaml.safe_load(f)
    # The 4-choice stream runs in 2 waves: no slot is held back for newcomers (reserved_slots
    # 1 would run it on one slot, 4 waves, past the drain grace).
    config.update(max_model_len=1024, num_slots=2, reserved_slots=0)
    config_path = tmp / "tiny-long.yaml"
    config_path.write_text(yaml.safe_dump(config))
    with serve_process(config_path, tmp, {"SPECRELAY_API_KEY": KEY},
                       ["--drain-grace", str(GRACE_S)], stop_timeout=GRACE_S + 30) as run:
        yield run.proc, run.base, run.port, run.log_path


def test_every_listening_socket_of_the_deployment_is_on_loopback(deployment):
    proc, base, port, _ = deployment
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text  # every stage actor has started and served
    sockets = listening_sockets(psutil.Process(proc.pid))
    names = {name for _, name, _, _ in sockets}
    # Not vacuous: Ray's own servers, the workers and Serve's HTTP proxy are all in the scan.
    assert {"gcs_server", "raylet"} <= names, sockets
    assert any(p == port for _, _, _, p in sockets), sockets
    assert len({pid for pid, _, _, _ in sockets}) >= 6, sockets
    exposed = [s for s in sockets if s[2] not in LOOPBACK]
    assert exposed == [], exposed


def test_serve_proxy_routes_need_the_key_but_a_local_healthz_probe_does_not(deployment):
    _, base, _, _ = deployment
    routes = httpx.get(f"{base}/-/routes", timeout=30)
    assert routes.status_code == 401 and routes.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(f"{base}/-/routes", headers=AUTH, timeout=30).status_code == 200
    # The test client is on loopback, like an in-pod probe: /-/healthz answers without the key.
    assert httpx.get(f"{base}/-/healthz", timeout=30).status_code == 200


def test_sigterm_refuses_new_requests_while_in_flight_ones_finish(deployment):
    proc, base, _, log_path = deployment
    body = {"prompt": "go", "max_tokens": 400, "n": 4, "ignore_eos": True, "stream": True}
    events: list[tuple[float, str]] = []
    chunks: list[dict] = []
    first = threading.Event()

    def consume():
        with httpx.stream("POST", f"{base}/v1/completions", headers=AUTH, json=body,
                          timeout=GRACE_S + 30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    events.append((time.monotonic(), "done"))
                    break
                chunks.append(json.loads(line[6:]))
                first.set()

    t = threading.Thread(target=consume)
    t.start()
    assert first.wait(60)
    t_term = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    # New requests are refused (503 + Retry-After while draining, or no listener at all).
    refused_at, statuses = None, []
    while refused_at is None and time.monotonic() - t_term < 30:
        try:
            r = httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=10,
                           json={"prompt": "new", "max_tokens": 2})
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "server_shutting_down"
                assert r.headers["retry-after"] == "1"
                assert httpx.get(f"{base}/health", timeout=10).status_code == 503
                refused_at = time.monotonic()
        except httpx.TransportError:
            refused_at = time.monotonic()
        time.sleep(0.05)
    t.join(GRACE_S + 30)
    assert refused_at is not None, statuses
    assert all(s in (200, 503) for s in statuses), statuses
    # The stream in flight finished normally: every choice ran to its length, then [DONE].
    assert events and events[0][1] == "done", events
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                for c in chunks if c["choices"][0]["finish_reason"]}
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}, finished
    text = {i: "".join(c["choices"][0]["text"] for c in chunks
                       if c["choices"][0]["index"] == i) for i in range(4)}
    assert all(text.values())
    assert refused_at < events[0][0], "the stream ended before a new request was refused"
    rc = proc.wait(timeout=GRACE_S + 30)
    assert rc == 0, log_path.read_text()[-3000:]
    assert time.monotonic() - t_term < GRACE_S + 30
