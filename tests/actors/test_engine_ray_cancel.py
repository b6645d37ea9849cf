"""A request cancelled by its client must not stall the engine's stage actors.

Ray cancels a cancelled task's children recursively. An output-stage call made on a request's
behalf (an abort, a registration) that is still queued behind an earlier call to the same
ordered actor (a `process` whose payload is still resolving) is then dropped before it is sent,
and the actor waits for its sequence number: 30 s, restarted by every later call, so the engine
stalled until the step timeout and failed every request (found by the soak test). `RayStages`
submits every stage call as the engine's own, so a request's cancellation cannot reach it.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from ray import cloudpickle

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]
# The actor classes below travel by value: Ray workers cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PAYLOAD_DELAY_S = 2.0


class StubOutput:
    """An ordered (single-threaded) stand-in for the output actor that records its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def process(self, payload: bytes) -> bytes:
        from pipeline.output.delta_codec import encode_deltas

        self.calls.append(f"process:{payload.decode()}")
        return encode_deltas([])

    def abort(self, rid: str) -> bytes:
        from pipeline.output.delta_codec import encode_deltas

        self.calls.append(f"abort:{rid}")
        return encode_deltas([])

    def add_request(self, req, traceparent) -> None:
        self.calls.append(f"add:{req}")

    def seen(self) -> list[str]:
        return list(self.calls)


def slow_payload() -> bytes:
    time.sleep(PAYLOAD_DELAY_S)
    return b"step-1"


class EngineLike:
    """Holds `RayStages` the way the Engine actor does: built by the engine, then used both by
    its step loop and on behalf of requests."""

    def __init__(self, output) -> None:
        self.output = output

    async def start(self) -> None:
        from actors.engine import RayStages, StageActors
        from pipeline.config import EngineConfig

        self.stages = RayStages(StageActors(draft=None, verifiers=[], output=self.output,
                                            placement_group=None), EngineConfig())

    async def step_with_slow_payload(self) -> None:
        import ray

        # The loop's `process` call, whose payload object is not ready yet.
        self.pending = asyncio.ensure_future(
            self.stages.process(ray.remote(slow_payload).remote()))

    async def request_then_abort(self, rid: str) -> None:
        # A request's call queued behind that process; then the request is cancelled.
        asyncio.ensure_future(self.stages.abort(rid))
        await asyncio.sleep(60)

    async def later_calls(self, n: int) -> None:
        for i in range(n):  # a steady stream of calls, like the step loop's
            await asyncio.wait_for(self.stages.abort(f"later-{i}"), 10)
            await asyncio.sleep(0.2)
        await self.pending


def test_a_cancelled_requests_stage_call_never_stalls_the_ordered_stage(ray_cluster):
    import ray

    output = ray.remote(StubOutput).options(num_cpus=0).remote()
    engine = ray.remote(EngineLike).options(num_cpus=0, max_concurrency=100).remote(output)
    ray.get(engine.start.remote())
    ray.get(engine.step_with_slow_payload.remote())
    request = engine.request_then_abort.remote("gone")
    time.sleep(0.5)
    ray.cancel(request, recursive=True)  # what Serve does when the HTTP client disconnects

    t0 = time.monotonic()
    ray.get(engine.later_calls.remote(5), timeout=30)
    took = time.monotonic() - t0
    calls = ray.get(output.seen.remote())
    # Every call ran, in submission order; the queue waited only for the payload.
    assert calls == ["process:step-1", "abort:gone", *[f"abort:later-{i}" for i in range(5)]]
    assert took < PAYLOAD_DELAY_S + 8, took
    for h in (engine, output):
        ray.kill(h)
