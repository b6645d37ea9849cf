"""Helpers for the reliability, fault and soak tests against a running Serve app: one HTTP
request's outcome (one terminal event per choice), engine stats and stage-actor pids through the
replica, process RSS, a /health poller."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil


@dataclass
class Outcome:
    """What a client saw for one request. `terminal[i]` is choice i's finish reason, or "error"
    when an error (in-band for a stream, the status for a JSON reply) ended it."""

    status: int
    n: int
    stream: bool
    text: dict[int, str] = field(default_factory=dict)
    terminal: dict[int, list[str]] = field(default_factory=dict)
    error: dict | None = None
    done: bool = False  # a stream's [DONE]
    body: Any = None
    chunks: int = 0
    tokens: dict[int, list[str]] = field(default_factory=dict)  # completions logprobs tokens
    spec: dict[int, dict] = field(default_factory=dict)  # a finished choice's spec_stats

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def check_one_terminal_each(self) -> None:
        """Every choice ended exactly once (a finish reason or the error), streams with [DONE]."""
        if self.status != 200:
            assert self.error is not None and self.error["message"], self
            return
        if self.stream:
            assert self.done, self
        for i in range(self.n):
            ends = self.terminal.get(i, [])
            if self.error is not None and not ends:
                continue  # the error event ended this choice
            assert len(ends) == 1, (i, self)


def completion(base: str, body: dict, headers: dict | None = None, timeout: float = 120,
               first_chunk: Any = None) -> Outcome:
    """POST /v1/completions (JSON or SSE); `first_chunk` (a threading.Event) is set on the
    first streamed chunk."""
    prompt = body.get("prompt")
    batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    n = body.get("n", 1) * (len(prompt) if batched else 1)  # choices
    if not body.get("stream"):
        r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=timeout)
        out = Outcome(r.status_code, n, False, body=r.json())
        if r.status_code != 200:
            out.error = out.body["error"]
            return out
        for c in out.body["choices"]:
            out.text[c["index"]] = c["text"]
            out.terminal[c["index"]] = [c["finish_reason"]]
            if "spec_stats" in c:
                out.spec[c["index"]] = c["spec_stats"]
            if c.get("logprobs"):
                out.tokens[c["index"]] = c["logprobs"]["tokens"]
        return out
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers,
                      timeout=timeout) as r:
        out = Outcome(r.status_code, n, True)
        if r.status_code != 200:
            r.read()
            out.body = r.json()
            out.error = out.body["error"]
            return out
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                break
            assert not out.done, "data after [DONE]"
            event = json.loads(line[6:])
            if "error" in event:
                assert out.error is None, "two error events"
                out.error = event["error"]
                continue
            out.chunks += 1
            if first_chunk is not None:
                first_chunk.set()
            for c in event["choices"]:
                i = c["index"]
                assert not out.terminal.get(i), f"choice {i} has output after its finish"
                out.text[i] = out.text.get(i, "") + c["text"]
                if c.get("logprobs"):
                    out.tokens.setdefault(i, []).extend(c["logprobs"]["tokens"])
                if c["finish_reason"] is not None:
                    out.terminal.setdefault(i, []).append(c["finish_reason"])
                if "spec_stats" in c:
                    out.spec[i] = c["spec_stats"]
    return out


def serve_handle(app_name: str):
    from ray import serve

    return serve.get_app_handle(app_name)


def engine_stats(app_name: str) -> dict[str, Any]:
    return serve_handle(app_name).engine_stats.remote().result(timeout_s=30)


def stage_pids(app_name: str) -> dict[str, Any]:
    """{"draft": pid, "verifiers": [pid per rank], "output": pid, "engine": pid}."""
    import ray

    engine = serve_handle(app_name).engine_actor.remote().result(timeout_s=30)
    actors = ray.get(engine.stage_actors.remote(), timeout=30)

    def pid(actor) -> int:
        return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)

    return {"draft": pid(actors["draft"]), "verifiers": [pid(v) for v in actors["verifiers"]],
            "output": pid(actors["output"]), "engine": pid(engine)}


def wait_slots_free(app_name: str, num_slots: int, timeout: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(app_name)
        if (stats["free_slots"], stats["running"], stats["waiting"]) == (num_slots, 0, 0):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def deployment_rss(app_name: str) -> int:
    """RSS bytes of the engine and its stage actors (the processes requests allocate in)."""
    pids = stage_pids(app_name)
    total = 0
    for pid in [pids["engine"], pids["draft"], pids["output"], *pids["verifiers"]]:
        total += psutil.Process(pid).memory_info().rss
    return total


class HealthWatch:
    """Polls /health every 50 ms in a thread until closed: every (time, status) it saw (0: no
    answer), when it first saw 503, and the first 200 after that."""

    def __init__(self, base: str) -> None:
        self.base, self.stop = base, threading.Event()
        self.samples: list[tuple[float, int]] = []
        self.reasons: list[str] = []  # the bodies of answers other than 200
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as c:
            while not self.stop.is_set():
                try:
                    r = c.get(f"{self.base}/health")
                    status = r.status_code
                    if status != 200:
                        self.reasons.append(r.text[:300])
                except httpx.HTTPError as e:
                    status = 0
                    self.reasons.append(repr(e))
                self.samples.append((time.monotonic(), status))
                time.sleep(0.05)

    @property
    def first_503(self) -> float | None:
        return next((t for t, s in self.samples if s == 503), None)

    @property
    def back_200(self) -> float | None:
        first = self.first_503
        if first is None:
            return None
        return next((t for t, s in self.samples if t > first and s == 200), None)

    def statuses(self) -> list[int]:
        return [s for _, s in self.samples]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
