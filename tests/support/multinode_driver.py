"""Driver of tests/e2e/test_multinode.py, run as its own process (a pytest process may already hold
another Ray): joins the three-node cluster, starts an engine placed across the nodes, checks
lossless output, then kills node B's raylet mid-generation and waits for the node to come back.

    python tests/support/multinode_driver.py ADDRESS TRACE_DIR RAYLET_PID_OF_NODE_B

Prints JSON lines: {"event": "restart-node-b"} (the test restarts node B, then writes a line to
stdin) and finally {"event": "result", ...} with what it saw; the test asserts on that.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
sys.path[:0] = [ROOT, TESTS]  # run as a script: the repository and `support` importable

from actors.engine import start_engine, stop_engine
from actors.engine_client import EngineClient
from pipeline.config import load_config
from pipeline.models.runners import build_runner
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall
from support.reference_decode import greedy_reference

PROMPTS = [[1, 5, 9, 14, 3], [1, 40, 41, 42], [1, 7, 7, 7, 7, 7, 30], [1, 99, 12]]
NEW_TOKENS = 24
# Placement: the engine and the draft on the head, one TP rank on each worker (each worker has one
# `sr_tp`), the output actor on node A. The trace then spans head (engine) and A (output).
PLACEMENT = {"verifier_strategy": "PACK", "verifier_resources": {"sr_tp": 1},
             "engine_resources": {"sr_head": 0.1}, "draft_resources": {"sr_head": 0.1},
             "output_resources": {"sr_a": 0.1}}
STEP_TIMEOUT_S = 10.0
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


async def collect(client: EngineClient, rid: str, prompt: list[int], params: SamplingParams,
                  traceparent: str | None = None) -> list[int]:
    out: list[int] = []
    async for delta in client.generate(EngineCall(rid, prompt, params, traceparent)):
        out.extend(delta.token_ids)
    return out


def node_of_actors(handles: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Actor name -> {node: the node's custom resource tag, pid} from the GCS actor table."""
    import ray
    from ray._private import state

    tag = {n["NodeID"]: next((r for r in n["Resources"] if r.startswith("sr_node_")), "?")
           for n in ray.nodes() if n["Alive"]}
    where = {}
    for name, handle in handles.items():
        info = state.actors(actor_id=handle._actor_id.hex())
        where[name] = {"node": tag.get(info["Address"]["NodeID"], "?"), "pid": info["Pid"]}
    return where


async def wait_health(client: EngineClient, healthy: bool, limit_s: float) -> tuple[float, dict]:
    start = time.monotonic()
    while True:
        try:
            state = await asyncio.wait_for(client.health(), 15)
        except Exception as e:  # noqa: BLE001 - an unreachable engine is unhealthy
            state = {"healthy": False, "reason": repr(e)}
        if bool(state.get("healthy")) == healthy or time.monotonic() - start > limit_s:
            return time.monotonic() - start, state
        await asyncio.sleep(0.5)


async def main(address: str, trace_dir: str, raylet_b: int) -> dict[str, Any]:
    import ray

    ray.init(address=address, log_to_driver=False)
    deadline = time.monotonic() + 120
    while sum(n["Alive"] for n in ray.nodes()) < 3:  # both workers registered
        assert time.monotonic() < deadline, ray.nodes()
        await asyncio.sleep(0.5)
    overrides = {"placement": PLACEMENT, "step_timeout_s": STEP_TIMEOUT_S, "draft": "model",
                 "tracing": {"exporter": "file", "batch": False,
                             "file": os.path.join(trace_dir, "spans-{pid}.jsonl")}}
    config = load_config(os.path.join(ROOT, "configs", "tiny-tp2.yaml"),
                         overrides)
    runner = build_runner(config.replace(tensor_parallel_size=1, draft="none"))
    reference = [greedy_reference(runner, p, NEW_TOKENS) for p in PROMPTS]
    result: dict[str, Any] = {"reference": reference}

    t0 = time.monotonic()
    engine = start_engine(config)
    result["start_s"] = time.monotonic() - t0
    client = EngineClient(engine)
    try:
        stages = await engine.stage_actors.remote()
        result["placement"] = node_of_actors({
            "engine": engine, "draft": stages["draft"], "output": stages["output"],
            **{f"rank{i}": v for i, v in enumerate(stages["verifiers"])}})

        greedy = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        tp = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
        result["outputs"] = await asyncio.gather(*(
            collect(client, f"r{i}", p, greedy, tp if i == 0 else None)
            for i, p in enumerate(PROMPTS)))

        # Node loss mid-generation: long requests, then SIGKILL node B's raylet.
        long = SamplingParams(max_new_tokens=200, ignore_eos=True)
        started = asyncio.Event()

        async def in_flight(rid: str, prompt: list[int]) -> dict[str, Any]:
            got = 0
            try:
                async for delta in client.generate(EngineCall(rid, prompt, long)):
                    got += len(delta.token_ids)
                    started.set()
                    await asyncio.sleep(0.05)  # keep the request in flight past the kill
                return {"ended": "finished", "tokens": got}
            except Exception as e:  # noqa: BLE001 - the expected outcome
                return {"ended": "error", "error": f"{type(e).__name__}: {e}"[:300],
                        "at": time.monotonic(), "tokens": got}

        tasks = [asyncio.ensure_future(in_flight(f"k{i}", p)) for i, p in enumerate(PROMPTS[:2])]
        await asyncio.wait_for(started.wait(), 60)
        killed_at = time.monotonic()
        os.kill(raylet_b, signal.SIGKILL)
        ends = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for end in ends:
            if "at" in end:
                end["after_kill_s"] = round(end.pop("at") - killed_at, 2)
        result["in_flight"] = ends
        took, state = await wait_health(client, healthy=False, limit_s=60)
        result["unhealthy_after_kill_s"] = round(time.monotonic() - killed_at, 2)
        result["unhealthy_state"] = state
        # While node B is gone the engine cannot place its second rank: health says why.
        await asyncio.sleep(3)
        result["while_gone"] = (await wait_health(client, healthy=True, limit_s=0))[1]

        emit(event="restart-node-b")
        sys.stdin.readline()
        restarted = time.monotonic()
        took, state = await wait_health(client, healthy=True, limit_s=180)
        result["healthy_after_restart_s"] = round(took, 2)
        result["recovered_state"] = state
        result["after_recovery"] = await asyncio.wait_for(asyncio.gather(*(
            collect(client, f"again{i}", p, greedy) for i, p in enumerate(PROMPTS))), 120)
        result["recovery_total_s"] = round(time.monotonic() - restarted, 2)
        stages = await engine.stage_actors.remote()
        result["placement_after"] = node_of_actors(
            {f"rank{i}": v for i, v in enumerate(stages["verifiers"])})
        result["restarts"] = (await client.stats()).get("restarts")
    finally:
        stop_engine(engine)
        ray.shutdown()
    return result


if __name__ == "__main__":
    address, trace_dir, raylet_b = sys.argv[1], sys.argv[2], int(sys.argv[3])
    emit(event="result", **asyncio.run(main(address, trace_dir, raylet_b)))
