"""A bounded soak on the real service: an open-loop mix at ~1.2x measured capacity (streaming and
not, n = 1 or 2, stop strings, logprobs, random client disconnects) plus a fan-out client (2
prompts x n = 2 per request, back to back) for SPECRELAY_SOAK_S seconds (default 120).

Checks: every request sent is exactly one of completed / rejected (429) / errored / dropped by
its own client, with errored == 0; every response ended each choice exactly once; every
request answered whole satisfies the statistics identity (usage = sum over its choices of
1 + verify_ct + accepted_tokens); every
completed stream's text and tokens equal the same greedy request sent non-streamed afterwards;
/health answered 200 within the readiness-probe timeout (3 s) throughout; the engine never
failed (no stage rebuild); slots are all free afterwards and the RSS of the engine and stage
processes is back to its post-warm-up level (tolerance below).
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.reliability_support import completion, deployment_rss, engine_stats, wait_slots_free
from support.serve_helpers import app_fixture, metric

SOAK_S = float(os.environ.get("SPECRELAY_SOAK_S", "120"))
pytestmark = [pytest.mark.ray, pytest.mark.soak, pytest.mark.timeout(int(SOAK_S) + 300)]

APP = "specrelay-soak"
NUM_SLOTS, MAX_WAITING = 4, 8
LOAD_FACTOR = 1.2
CALIBRATE_S = 8.0
# RSS after the soak may exceed the post-warm-up level by allocator caches and Python heap
# high-water marks (the warm-up already ran at full concurrency): 10% + 48 MB over ~1 GB of
# five processes. A per-request leak (KV slots, request state, streams) over thousands of
# requests exceeds it; so does a leaked KV cache for even one slot set. Since the five processes
# start at 1.4-1.6 GB, 10% + 48 MB was within a few MB of what a clean run grows: 4b31df0 grew
# 129 and 172 MB from 1,410-1,424 MB, 7f49f3e 181-214 MB from 1,416-1,592 MB, and a fresh-clone
# CI failed by 7 MB. 15% + 48 MB leaves ~70 MB above the largest of those.
RSS_TOLERANCE = (0.15, 48 << 20)
# /health must answer within the chart's readiness-probe timeout (probes.readiness.timeoutSeconds)
# under load; the client threads of this test share the two CPUs with the whole service.
HEALTH_BOUND_MS = 3000
PROMPTS = ["The quick brown fox", "Once upon a time", "hello", "0123456789", "a b c d e f"]
STOPS = ["e", "th", "o ", "xyz", "\n"]
# The fan-out client: every request is 4 choices, as many as the slots.
FAN_OUT = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 32, "ignore_eos": True, "stream": True}


base = app_fixture(APP, "tiny.yaml", {"num_slots": NUM_SLOTS, "max_waiting": MAX_WAITING,
                                       "max_model_len": 512})


def random_request(rng: random.Random) -> tuple[dict, float | None]:
    """A request body and, for a client that will disconnect, after how many chunks (stream)
    or seconds (JSON) it gives up."""
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 64),
            "stream": rng.random() < 0.5, "n": 1 if rng.random() < 0.8 else 2}
    if rng.random() < 0.4:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.4:
        body["logprobs"] = rng.randint(0, 2)
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    give_up = None
    if rng.random() < 0.1:
        give_up = rng.randint(1, 3) if body["stream"] else rng.uniform(0.02, 0.3)
    return body, give_up


def send(base: str, body: dict, give_up: float | None) -> tuple[str, object]:
    """("completed" | "rejected" | "errored" | "dropped", the Outcome or the reason)."""
    if give_up is None:
        out = completion(base, body, timeout=120)
        out.check_one_terminal_each()
        if out.status == 429:
            return "rejected", out
        return ("completed" if out.ok else "errored"), out
    if not body["stream"]:
        try:
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=give_up)
        except httpx.TimeoutException:
            return "dropped", "timeout"
        return ("rejected" if r.status_code == 429 else
                "completed" if r.status_code == 200 else "errored"), r.status_code
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return ("rejected" if r.status_code == 429 else "errored"), r.status_code
        for i, line in enumerate(r.iter_lines()):
            if line == "data: [DONE]":
                return "completed", "before giving up"
            if i >= give_up * 2:  # events are separated by a blank line
                return "dropped", "mid-stream"
    return "errored", "stream ended without [DONE]"


def calibrate(base: str, rng: random.Random) -> float:
    """Requests per second the service completes when every slot is kept busy (closed loop)."""
    done = []
    stop_at = time.monotonic() + CALIBRATE_S

    def worker():
        while time.monotonic() < stop_at:
            body, _ = random_request(rng)
            kind, _ = send(base, body, None)
            assert kind == "completed"
            done.append(time.monotonic())

    t0 = time.monotonic()
    with ThreadPoolExecutor(NUM_SLOTS) as pool:
        for f in [pool.submit(worker) for _ in range(NUM_SLOTS)]:
            f.result()
    return len(done) / (time.monotonic() - t0)


def test_soak_at_1_2x_capacity_keeps_every_invariant(base):
    rng = random.Random(1234)
    capacity = calibrate(base, rng)
    assert capacity > 0
    wait_slots_free(APP, NUM_SLOTS)
    rss_before = deployment_rss(APP)
    metrics_before = httpx.get(f"{base}/metrics", timeout=10).text

    # Open loop: Poisson arrivals at 1.2x capacity, decided up front (seeded).
    rate = LOAD_FACTOR * capacity
    schedule, t = [], 0.0
    while t < SOAK_S:
        t += rng.expovariate(rate)
        schedule.append((t, *random_request(rng)))
    health_ms: list[float] = []
    max_waiting_seen = [0]
    stop = threading.Event()

    def watch():
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                status = c.get(f"{base}/health").status_code
                health_ms.append((time.monotonic() - t0) * 1000 if status == 200 else 1e9)
                max_waiting_seen[0] = max(max_waiting_seen[0], engine_stats(APP)["waiting"])
                time.sleep(0.5)

    fan_outs: list[str] = []

    def fan_out_client():
        while not stop.is_set():
            out = completion(base, FAN_OUT, timeout=120)
            out.check_one_terminal_each()
            fan_outs.append("rejected" if out.status == 429 else
                            "completed" if out.ok else f"errored: {out.error}")
            if out.status == 429:
                time.sleep(0.2)

    results = []
    with ThreadPoolExecutor(64) as pool:
        watcher = pool.submit(watch)
        fan_out = pool.submit(fan_out_client)
        start = time.monotonic()
        futures = []
        for at, body, give_up in schedule:
            time.sleep(max(0.0, start + at - time.monotonic()))
            futures.append((body, give_up, pool.submit(send, base, body, give_up)))
        for body, give_up, f in futures:
            results.append((body, give_up, *f.result(timeout=180)))
        stop.set()
        watcher.result(timeout=30)
        fan_out.result(timeout=150)

    kinds = [k for _, _, k, _ in results]
    count = {k: kinds.count(k) for k in ("completed", "rejected", "errored", "dropped")}
    assert sum(count.values()) == len(schedule), count  # nothing lost, nothing doubled
    assert count["errored"] == 0, [getattr(r[3], "error", r[3]) for r in results
                                   if r[2] == "errored"][:3]
    assert count["completed"] >= len(schedule) // 2, count
    assert max_waiting_seen[0] > 0, "the load never queued: not overloaded"
    assert health_ms and max(health_ms) < HEALTH_BOUND_MS, sorted(health_ms)[-5:]
    assert "completed" in fan_outs and all(k in ("completed", "rejected") for k in fan_outs), \
        [k for k in fan_outs if k.startswith("errored")][:3]

    # Server-side accounting agrees: every 429 a client saw was counted by the server; the
    # server may have answered 429 to a client that had already given up (dropped).
    metrics_after = httpx.get(f"{base}/metrics", timeout=10).text
    key = 'specrelay_http_requests_total{route="/v1/completions",status="429"}'
    served_429 = metric_or_zero(metrics_after, key) - metric_or_zero(metrics_before, key)
    rejected = count["rejected"] + fan_outs.count("rejected")
    assert rejected <= served_429 <= rejected + count["dropped"], (served_429, count, fan_outs)

    stats = wait_slots_free(APP, NUM_SLOTS)
    assert stats["healthy"]
    # Overload and disconnects are not faults: the engine never failed and rebuilt its stages.
    assert stats["restarts"] == 0, stats
    rss_after = deployment_rss(APP)
    frac, extra = RSS_TOLERANCE
    assert rss_after <= rss_before * (1 + frac) + extra, (rss_before >> 20, rss_after >> 20)
    # The statistics identity holds for every request answered whole: each choice's tokens are
    # 1 (the prefill's) + one per verify step + the accepted drafts, so usage is their sum.
    whole = [out for b, g, k, out in results if k == "completed" and g is None
             and not b["stream"]]
    assert whole
    for out in whole:
        assert sorted(out.spec) == list(range(out.n)), out.body
        assert out.body["usage"]["completion_tokens"] == sum(
            1 + s["verify_ct"] + s["accepted_tokens"] for s in out.spec.values()), out.body
        assert all(s["accepted_tokens"] <= s["draft_tokens"] for s in out.spec.values())
    # Every completed stream equals the same greedy request, non-streamed.
    streams = [(b, out) for b, g, k, out in results if k == "completed" and g is None
               and b["stream"]]
    assert streams
    differ = []
    for body, out in streams[:40]:
        again = completion(base, {**body, "stream": False}, timeout=60)
        assert again.ok, again
        if (out.text, out.terminal, out.tokens) != (again.text, again.terminal, again.tokens):
            differ.append((body, (out.terminal, out.tokens, out.text),
                           (again.terminal, again.tokens, again.text)))

    print(f"soak: capacity {capacity:.2f} req/s, {count}, fan-out client: "
          f"{fan_outs.count('completed')} completed, {fan_outs.count('rejected')} rejected; "
          f"rss {rss_before >> 20} -> "
          f"{rss_after >> 20} MiB, health max {max(health_ms):.0f} ms, "
          f"{len(differ)}/{len(streams[:40])} streams differ from their non-streamed replay")
    assert differ == [], differ[:2]  # (body, streamed, replayed)


def metric_or_zero(text: str, name: str) -> float:
    try:
        return metric(text, name)
    except KeyError:
        return 0.0
