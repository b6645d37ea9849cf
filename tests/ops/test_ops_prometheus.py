"""A real Prometheus scrapes a real server (the HTTP app over the in-process tiny engine, no
fakes) while it serves mixed traffic; then every dashboard query and every alert expression is
evaluated through Prometheus's HTTP API. Each must parse, each dashboard query must return data,
and the speculation row's acceptance must equal the responses' pooled spec_stats.

Prometheus (Debian's `prometheus` package, `make install`) runs on a free loopback port with a
temporary config and storage; without the binary the test skips saying so.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from support.ops_support import binary
from support.serve_helpers import free_port

from pipeline.config import load_config
from pipeline.engine.core import EngineCore
from pipeline.engine.local import build_local_engine
from pipeline.frontend.app import ServerSettings, create_app
from pipeline.ops.alerts import ALERTS
from pipeline.ops.dashboard import queries
from pipeline.protocol.engine_call import EngineCall

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.usefixtures("one_torch_thread")]

KEY = "ops-test-key"
SCRAPE_S = 1
WINDOW = "1m"  # what $__rate_interval stands for here


class InProcessEngine:
    """The front end's engine API over an EngineCore on the server's own event loop."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.started = False

    def _start(self) -> None:
        if not self.started:
            self.core.start()
            self.started = True

    async def generate(self, call: EngineCall) -> Any:
        self._start()
        stream = await self.core.add_request(call)
        async for delta in stream:
            yield delta

    async def abort(self, rid: str) -> None:
        await self.core.abort(rid)

    async def stats(self) -> dict[str, Any]:
        self._start()
        stats = await self.core.stats_dict()
        return {**stats, "restarts": 0}

    async def health(self) -> dict[str, Any]:
        return self.core.health()

    async def model_info(self) -> dict[str, Any]:
        c = self.core.config
        return {"name": c.served_name, "source": c.model, "max_model_len": c.max_model_len,
                "vocab_size": 256, "eos_token_ids": []}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    core = build_local_engine(load_config("configs/tiny.yaml", {"num_slots": 4}))
    app = create_app(InProcessEngine(core), core.stages.verifier.runner.tokenizer,
                     ServerSettings(api_key=KEY))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    yield base
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory) -> Iterator[str]:
    exe = binary("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    host = server.removeprefix("http://")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [{"job_name": "specrelay", "metrics_path": "/metrics",
                            "authorization": {"credentials": KEY},
                            "static_configs": [{"targets": [host]}]}]}))
    port = free_port()
    proc = subprocess.Popen(
        [exe, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(tmp / "log", "w"))  # noqa: SIM115
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp / "log").read_text()
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def query(prom: str, expr: str) -> dict:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]


def send_traffic(base: str) -> tuple[int, int]:
    """Mixed traffic; returns the pooled (accepted, drafted) of the responses' spec_stats."""
    auth = {"Authorization": f"Bearer {KEY}"}
    bodies = (
        [{"prompt": f"the cat sat on {i}", "max_tokens": 24} for i in range(6)]  # drafting
        + [{"prompt": "one two", "max_tokens": 2}, {"prompt": "x", "max_tokens": 1}]  # no drafts
        + [{"prompt": "stop here", "max_tokens": 30, "stop": ["a", "e"]},  # stop strings
           {"prompt": "seeded", "max_tokens": 16, "temperature": 0.8, "seed": 7}])
    accepted = drafted = 0

    async def one(client: httpx.AsyncClient, body: dict, path: str = "/v1/completions") -> None:
        nonlocal accepted, drafted
        r = await client.post(path, json={"model": "tiny", **body})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            accepted += choice["spec_stats"]["accepted_tokens"]
            drafted += choice["spec_stats"]["draft_tokens"]

    async def go() -> None:
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=60) as client:
            await asyncio.gather(*(one(client, b) for b in bodies))
            bad = [{"model": "tiny", "prompt": "x", "max_tokens": -1},  # 400
                   {"model": "tiny", "prompt": "x", "temperature": "hot"},  # 400
                   {"model": "nope", "prompt": "x"}]  # 404
            for body in bad:
                assert (await client.post("/v1/completions", json=body)).status_code in (400, 404)
            await one(client, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12},
                      "/v1/chat/completions")
        assert (await httpx.AsyncClient().get(f"{base}/metrics")).status_code == 401

    asyncio.run(go())
    return accepted, drafted


def test_every_dashboard_query_and_alert_evaluates_on_a_real_prometheus(server, prometheus):
    accepted, drafted = send_traffic(server)
    assert drafted > 0
    # wait until Prometheus has scraped the finished traffic (and a few samples for rate())
    deadline = time.monotonic() + 30
    while True:
        got = query(prometheus, "sum(specrelay_request_spec_draft_tokens_total)")["result"]
        if got and float(got[0]["value"][1]) == drafted:
            break
        assert time.monotonic() < deadline, f"scraped drafts {got}, responses {drafted}"
        time.sleep(SCRAPE_S)
    time.sleep(3 * SCRAPE_S)

    empty = []
    for expr in queries():
        data = query(prometheus, expr.replace("$__rate_interval", WINDOW))
        if not data["result"]:
            empty.append(expr)
    assert empty == [], "dashboard queries without data"

    for alert in ALERTS:
        query(prometheus, alert.expr)  # parses and evaluates
    # a healthy server: the no-healthy-engine and stall alerts' conditions are false
    for name in ("SpecrelayNoHealthyEngine", "SpecrelayStallDetected"):
        (alert,) = [a for a in ALERTS if a.name == name]
        assert query(prometheus, alert.expr)["result"] == [], name

    # the speculation row's acceptance since start = the responses' pooled spec_stats
    stat = next(e for e in queries() if e.startswith("sum(specrelay_request_spec_accepted"))
    (sample,) = query(prometheus, stat)["result"]
    assert float(sample["value"][1]) == pytest.approx(accepted / drafted, rel=0.01)
