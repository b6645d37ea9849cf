"""Replica loss (issue 44, must-show 4): two engine replicas serve streams; one replica's Engine
actor is SIGKILLed mid-traffic. Its in-flight requests end with an error within 10 s, the other
replica's requests finish with 0 errors, /health stays 200 throughout (one replica serves),
Serve replaces the lost replica (a new one under a new id, serving again), and prefix routing,
which forgot the lost replica, sends a repeated prompt back to the cache that holds it.

Which replica served a request is read from the replicas' `spec.replica.request` spans (file
exporter), whose `request.id` is the response id plus the choice index."""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time

import httpx
import pytest
from support.reliability_support import HealthWatch
from support.serve_helpers import ROOT, running_app

from pipeline.tracing.trace_file import read_spans

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

APP = "replica-loss"
STREAMS = 8
ERROR_WITHIN_S = 10.0


class Stream:
    """One streaming completion read in a thread: its id, when it ended, and how."""

    def __init__(self, base: str, index: int) -> None:
        self.base, self.index = base, index
        self.id: str | None = None
        self.first = threading.Event()
        self.end: str | None = None  # "length", "error" or the transport failure
        self.ended_at = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": "tiny", "prompt": f"stream {self.index} " * 4, "max_tokens": 1600,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=body,
                              timeout=300) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.end = "error"
                        break
                    self.id = event["id"]
                    self.first.set()
                    reason = event["choices"][0]["finish_reason"]
                    if reason is not None:
                        self.end = reason
                        break
        except httpx.HTTPError as e:
            self.end = f"transport: {e!r}"
        self.ended_at = time.monotonic()
        self.first.set()


def engine_actors() -> dict:
    from ray import serve

    return serve.get_app_handle(APP).engine_actors.remote().result(timeout_s=30)


def stage_groups() -> list[str]:
    """Names of the engines' placement groups that hold resources (one per live engine)."""
    import ray

    return [pg["name"] for pg in ray.util.placement_group_table().values()
            if pg["name"].startswith("specrelay-stages:") and pg["state"] != "REMOVED"]


def test_losing_one_replica_ends_only_its_requests_and_serve_replaces_it(ray_cluster, tmp_path):
    import ray

    tracing = {"exporter": "file", "batch": False,
               "file": str(tmp_path / "spans-{pid}.jsonl")}
    overrides = {"max_model_len": 2048, "draft": "none", "tracing": tracing}
    with running_app({"config": os.path.join(ROOT, "configs", "tiny.yaml"), "api_key": "",
                      "overrides": overrides,
                      "deployment": {"replicas": 2, "routing": "prefix"}}, name=APP) as base:
        before = engine_actors()
        assert len(before) == 2
        watch = HealthWatch(base)
        streams = [Stream(base, i) for i in range(STREAMS)]
        for s in streams:
            assert s.first.wait(120) and s.id is not None, s.end
        assert all(s.end is None for s in streams), [s.end for s in streams]
        victim, engine = next(iter(before.items()))
        pid = ray.get(engine.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for s in streams:
            s.thread.join(300)
        # Serve replaces the replica whose engine died: a new id, two engines again, and the
        # dead engine's placement group is gone (Ray alone would keep it until the job ends).
        deadline = time.monotonic() + 180
        while True:
            now, groups = engine_actors(), stage_groups()
            if len(now) == 2 and victim not in now and len(groups) == 2:
                break
            assert time.monotonic() < deadline, (now, groups)
            time.sleep(1)
        # Prefix affinity re-learns: a prompt sent twice reaches the cache of its first replica.
        again = [httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "again and again " * 8, "max_tokens": 8,
            "ignore_eos": True}) for _ in range(2)]
        watch.close()
    deadline = time.monotonic() + 30  # the app stopped: nothing of its engines is left
    while stage_groups():
        assert time.monotonic() < deadline, stage_groups()
        time.sleep(0.5)

    served_by = {s.attributes["request.id"]: s.attributes["serve.replica"]
                 for s in read_spans(glob.glob(str(tmp_path / "spans-*.jsonl")))
                 if s.name == "spec.replica.request"}
    replica = {s.index: served_by[f"{s.id}-0"] for s in streams}
    ends = {s.index: (replica[s.index], s.end, round(s.ended_at - killed_at, 2))
            for s in streams}
    print("\nreplica loss: " + json.dumps({"victim": victim, "ends": ends,
                                           "health": sorted(set(watch.statuses()))}))
    lost = [s for s in streams if replica[s.index] == victim]
    kept = [s for s in streams if replica[s.index] != victim]
    assert lost and kept, ends  # both replicas had requests in flight
    for s in lost:
        assert s.end == "error" and s.ended_at - killed_at <= ERROR_WITHIN_S, ends
    assert [s.end for s in kept] == ["length"] * len(kept), ends
    assert watch.statuses() and set(watch.statuses()) == {200}, watch.reasons
    assert [r.status_code for r in again] == [200, 200]
    assert again[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 112
