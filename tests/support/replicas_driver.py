"""Driver of tests/e2e/test_replicas_multinode.py, run as its own process (a pytest process may
already hold another Ray): joins the three-node cluster, serves the tiny model with one engine
replica, then with two, sends the same greedy requests to each (every request with its own
`traceparent`), and prints {"event": "result", ...}: the answers, which node each replica's
actors run on, and the request -> trace id map (spans go to TRACE_DIR, one file per process).

    python tests/support/replicas_driver.py ADDRESS TRACE_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
sys.path[:0] = [ROOT, TESTS]  # run as a script: the repository and `support` importable

import httpx

from support.multinode_driver import node_of_actors
from support.serve_helpers import free_port, wait_healthy

PROMPTS = [[1, 5, 9, 14, 3], [1, 40, 41, 42], [1, 7, 7, 7, 7, 7, 30], [1, 99, 12],
           [1, 60, 61, 62, 63], [1, 8, 120, 8, 121], [1, 33] * 4, [1, 200, 201]]
NEW_TOKENS = 24


def trace_id(replicas: int, i: int) -> str:
    return f"{replicas:016x}{i + 1:016x}"


def ask(base: str, replicas: int, i: int) -> dict[str, Any]:
    tp = f"00-{trace_id(replicas, i)}-00f067aa0ba902b7-01"
    r = httpx.post(f"{base}/v1/completions", headers={"traceparent": tp}, timeout=120, json={
        "model": "tiny", "prompt": PROMPTS[i], "max_tokens": NEW_TOKENS, "ignore_eos": True,
        "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return {"id": body["id"], "text": body["choices"][0]["text"],
            "trace_id": trace_id(replicas, i)}


def serve_and_ask(replicas: int, trace_dir: str) -> dict[str, Any]:
    import ray
    from ray import serve

    from actors.serve_app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    try:
        tracing = {"exporter": "file", "batch": False,
                   "file": os.path.join(trace_dir, "spans-{pid}.jsonl")}
        t0 = time.monotonic()
        app = f"mn-{replicas}"
        serve.run(build_app({"config": os.path.join(ROOT, "configs", "tiny.yaml"), "api_key": "",
                             "overrides": {"tracing": tracing},
                             "deployment": {"replicas": replicas}}),
                  name=app, route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, timeout=240)
        started = time.monotonic() - t0
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda i: ask(base, replicas, i), range(len(PROMPTS))))
        engines = serve.get_app_handle(app).engine_actors.remote().result(timeout_s=30)
        placement = {}
        for replica, engine in engines.items():
            stages = ray.get(engine.stage_actors.remote(), timeout=30)
            placement[replica] = node_of_actors({
                "engine": engine, "output": stages["output"],
                **{f"rank{i}": v for i, v in enumerate(stages["verifiers"])}})
        return {"start_s": round(started, 1), "answers": answers, "placement": placement}
    finally:
        serve.shutdown()


def main(address: str, trace_dir: str) -> dict[str, Any]:
    import ray

    ray.init(address=address, log_to_driver=False)
    deadline = time.monotonic() + 120
    while sum(n["Alive"] for n in ray.nodes()) < 3:
        assert time.monotonic() < deadline, ray.nodes()
        time.sleep(0.5)
    try:
        return {"one": serve_and_ask(1, trace_dir), "two": serve_and_ask(2, trace_dir)}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    print(json.dumps({"event": "result", **main(sys.argv[1], sys.argv[2])}), flush=True)
