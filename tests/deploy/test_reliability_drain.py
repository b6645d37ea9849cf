"""Drain without Ray: while draining, new requests get 503 + Retry-After and /health is 503,
requests in flight finish; the Helm chart's drain period, preStop hook, pod grace and Serve's
graceful_shutdown_timeout_s agree (the chart's NetworkPolicy and Ray token auth are covered by
test_helm.py: test_network_policy_lets_only_ray_pods_reach_ray_ports,
test_ray_token_auth_is_set_on_head_and_workers)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import yaml
from support.helm_chart import pod_specs, ray_container, render_drain
from support.server_fakes import ByteTok, FakeEngine

from actors.serve_app import DRAIN_GRACE_S, EngineReplica, SpecrelayServer, build_app
from pipeline.frontend.app import ServerSettings, create_app

pytestmark = pytest.mark.timeout(120)


def test_drain_refuses_new_requests_and_lets_in_flight_ones_finish():
    engine = FakeEngine(step_delay=0.02)  # 40 windows of 3 tokens: about a second
    app = create_app(engine, ByteTok(), ServerSettings(api_key=""))
    server = app.state.server

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            body = {"prompt": "hi", "max_tokens": 120, "n": 2}
            stream = asyncio.ensure_future(c.post("/v1/completions", json={**body,
                                                                            "stream": True}))
            plain = asyncio.ensure_future(c.post("/v1/completions", json=body))
            while server.inflight.value < 2:
                assert not (stream.done() or plain.done())
                await asyncio.sleep(0.01)
            drained = asyncio.ensure_future(server.drain(30))
            await asyncio.sleep(0.05)
            refused = await c.post("/v1/completions", json={"prompt": "new"})
            health = await c.get("/health")
            left = await drained
            return await stream, await plain, refused, health, left

    stream, plain, refused, health, left = asyncio.run(main())
    assert left == 0 and server.inflight.value == 0
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert health.status_code == 503 and health.json()["reason"] == "draining"
    assert [c["finish_reason"] for c in plain.json()["choices"]] == ["length", "length"]
    events = [json.loads(b[6:]) for b in stream.text.split("\n\n")
              if b.startswith("data: {")]
    assert stream.text.rstrip().endswith("data: [DONE]")
    assert sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"]) == [0, 1]


def test_drain_gives_up_after_its_timeout_and_reports_what_is_left():
    app = create_app(FakeEngine(hang=True), ByteTok(), ServerSettings(api_key=""))
    server = app.state.server

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            hung = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "x"}))
            while server.inflight.value < 1:
                await asyncio.sleep(0.01)
            left = await server.drain(0.3)
            hung.cancel()
            return left

    assert asyncio.run(main()) == 1


@pytest.mark.parametrize("grace, shutdown", [(None, None), (45, 5)])
def test_helm_drain_period_is_serves_graceful_shutdown_and_the_prestop_sleep(grace, shutdown):
    rs, grace, shutdown = render_drain(grace, shutdown)
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    # Both deployments drain: the ingress's HTTP streams and each engine replica's (scale-down).
    assert {d["name"]: d["graceful_shutdown_timeout_s"] for d in app["deployments"]} == {
        SpecrelayServer.name: grace, EngineReplica.name: grace}
    for template in pod_specs(rs).values():
        assert template["spec"]["terminationGracePeriodSeconds"] == grace + shutdown
        assert ray_container(template)["lifecycle"]["preStop"]["exec"]["command"][-1] == (
            f"sleep {grace}")


def chart_values_path() -> str:
    from support.helm_chart import CHART

    return str(CHART / "values.yaml")


def test_serve_deployment_drain_defaults_match_the_chart_and_args_override_them():
    with open(chart_values_path()) as f:
        values = yaml.safe_load(f)
    assert DRAIN_GRACE_S == values["drain"]["gracePeriodSeconds"]
    assert SpecrelayServer._deployment_config.graceful_shutdown_timeout_s == DRAIN_GRACE_S
    app = build_app({"config": None, "drain_grace_s": 12})
    assert app._bound_deployment._deployment_config.graceful_shutdown_timeout_s == 12
