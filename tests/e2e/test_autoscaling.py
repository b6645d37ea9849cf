"""Autoscaling of the engine deployment (issue 44, must-show 5), with the tiny random engine.

A config with short autoscaling delays (min 1, max 2 replicas, 2 requests in flight per replica)
under a load ramp: six clients stream completions until Serve runs a second engine replica, then
two clients keep streaming long completions (one per replica, about what one replica is sized
for) until Serve drains and removes a replica, then the load stops. The deployment goes 1 -> 2 ->
1 replicas (read from `serve.status()`), and every request of the run succeeds: each stream ends
with its full `max_tokens` and `[DONE]`, including those the drained replica was serving when
Serve began to stop it (the replica waits for its streams, graceful_shutdown_timeout_s).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from support.serve_helpers import ROOT, running_app

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]

APP = "specrelay-autoscale"
ENGINE_DEPLOYMENT = "EngineReplica"
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
               "upscale_delay_s": 1, "downscale_delay_s": 3,
               "metrics_interval_s": 0.5, "look_back_period_s": 2}
OVERRIDES = {"deployment": {"routing": "pow2", "autoscaling": AUTOSCALING},
             "max_model_len": 1100, "num_slots": 4}
LONG_TOKENS = 1000  # a long stream outlasts Serve's scale-down decision (400 did not, always)


@dataclass
class Load:
    """Clients streaming completions in a loop; `clients` may change while it runs (0: stop)."""

    base: str
    clients: int = 0
    max_tokens: int = 32
    results: list[tuple[str, str]] = field(default_factory=list)  # (status, detail)
    inflight: int = 0
    stop: bool = False

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        async with httpx.AsyncClient(base_url=self.base, timeout=120) as client:
            workers = [asyncio.create_task(self._worker(client, i)) for i in range(8)]
            await asyncio.gather(*workers)

    async def _worker(self, client: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not self.stop:
            if i >= self.clients:
                await asyncio.sleep(0.05)
                continue
            n += 1
            self.inflight += 1
            try:
                self.results.append(await self._one(client, f"client {i} request {n}"))
            except Exception as e:  # noqa: BLE001 - any failure is a failed request
                self.results.append(("failed", f"client {i} request {n}: {e!r}"))
            finally:
                self.inflight -= 1

    async def _one(self, client: httpx.AsyncClient, name: str) -> tuple[str, str]:
        max_tokens = self.max_tokens
        body = {"model": "tiny", "prompt": f"{name}: tell me more", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        finish, usage, done = None, None, False
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return "failed", f"{name}: HTTP {r.status_code} {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "failed", f"{name}: {event['error']}"
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
        if not (done and finish == "length" and usage
                and usage["completion_tokens"] == max_tokens):
            return "failed", f"{name}: done={done} finish={finish} usage={usage}"
        return "ok", name


def replica_states() -> dict[str, int]:
    from ray import serve

    status = serve.status().applications[APP].deployments[ENGINE_DEPLOYMENT]
    return {str(k): v for k, v in status.replica_states.items() if v}


def running_requests() -> list[int]:
    """Requests running or waiting in every live engine replica's engine."""
    import ray

    counts = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(f"specrelay-engine:{APP}:"):
            try:
                engine = ray.get_actor(entry["name"], entry["namespace"])
                stats = ray.get(engine.stats.remote(), timeout=10)
            except Exception:  # noqa: BLE001, S112 - gone meanwhile
                continue
            counts.append(int(stats.get("running", 0)) + int(stats.get("waiting", 0)))
    return counts


def placement_groups() -> int:
    """Placement groups alive in the cluster: each engine replica holds one (its TP ranks)."""
    import ray

    return sum(pg["state"] == "CREATED" for pg in ray.util.placement_group_table().values())


def wait_for(condition, timeout: float, what: str, seen: list) -> float:
    """Poll `condition()` (also logging the replica states into `seen`); seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        states = replica_states()
        if not seen or seen[-1] != states:
            seen.append(states)
        if condition(states):
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; states: {seen}")


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def test_a_load_ramp_scales_the_engine_deployment_1_2_1_with_no_failed_request(ray_cluster):
    app_args = {"config": TINY, "overrides": OVERRIDES, "request_timeout_s": 120}
    groups_before = placement_groups()
    with running_app(app_args, name=APP) as base:
        seen: list[dict[str, int]] = []
        assert replica_states() == {"RUNNING": 1}
        assert placement_groups() == groups_before + 1
        load = Load(base, clients=6, max_tokens=48)
        thread = threading.Thread(target=load.run, daemon=True)
        thread.start()
        try:
            up_s = wait_for(lambda s: s.get("RUNNING", 0) == 2, 150, "a second replica", seen)
            time.sleep(3)  # both replicas serve
            groups_at_two = placement_groups()
            # Down to about one replica's worth: long streams, one per replica, while Serve
            # decides to scale down and drains the replica it stops. Placed one at a time, on
            # idle engines, so the router sends the second to the replica the first is not on
            # (whichever replica Serve stops is then serving one); the pauses are well under
            # downscale_delay_s, so Serve cannot scale down before they run.
            load.clients = 0
            wait_until(lambda: load.inflight == 0, 60, "the short streams to end")
            wait_until(lambda: sum(running_requests()) == 0, 30, "idle engines")
            load.max_tokens, load.clients = LONG_TOKENS, 1
            wait_until(lambda: sum(running_requests()) == 1, 30, "the first long stream")
            load.clients = 2
            drained_busy: list[list[int]] = []
            stopping_since: list[float] = []

            def back_to_one(states: dict[str, int]) -> bool:
                if states.get("STOPPING") and not drained_busy:
                    stopping_since.append(time.monotonic())
                    drained_busy.append(running_requests())
                return states == {"RUNNING": 1}

            down_s = wait_for(back_to_one, 150, "the scale-down to one replica", seen)
            drain_s = time.monotonic() - stopping_since[0] if stopping_since else None
            load.clients = 0  # the load stops
            deadline = time.monotonic() + 60
            while load.inflight and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(6)  # past downscale_delay_s: min_replicas holds, nothing else changes
            final = replica_states()
            groups_at_end = placement_groups()
        finally:
            load.stop = True
            thread.join(timeout=60)

    failed = [d for s, d in load.results if s != "ok"]
    print(f"states {seen}; up after {up_s:.1f}s of load, down after {down_s:.1f}s of low load; "
          f"{len(load.results)} requests, engines' running+waiting when one was stopping: "
          f"{drained_busy}, stopping for {drain_s}s")
    assert final == {"RUNNING": 1}
    assert {"RUNNING": 2} in seen
    # One replica = one placement group: the second replica made its own, and the one Serve
    # stopped took its group with it.
    assert (groups_at_two, groups_at_end) == (groups_before + 2, groups_before + 1)
    assert failed == [], failed
    assert len(load.results) >= 12
    # The replica Serve stopped was serving streams when it began to drain: every live engine
    # had requests then (so the stopping one did), and all of them finished whole (above).
    assert drained_busy and drained_busy[0] and min(drained_busy[0]) >= 1, drained_busy
