"""Faults on the real service (Ray Serve, tiny target split over two verifier ranks): SIGKILL of
the draft actor, of one verifier rank and of the output actor mid-generation, SIGKILL of an idle
output actor, and SIGSTOP of a verifier rank.

The draft actor's death costs nothing: every request completes with its fault-free output,
/health never answers 503, the engine is not rebuilt, and a new draft actor takes over. For the
others: every affected request ends with exactly one terminal event (a 503 or an in-band
error event, then [DONE]) within the documented bound, /health goes 503, the engine replaces
the failed stage (new pids: every verifier rank, or the output actor) and keeps the others
(same pids), all slots are free again, and a canary gives exactly the output it
gave before the fault, without restarting the service. Bounds: docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.reliability_support import (
    HealthWatch,
    completion,
    engine_stats,
    stage_pids,
    wait_slots_free,
)
from support.serve_helpers import app_fixture

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP = "specrelay-faults"
NUM_SLOTS = 4
# docs/reliability.md
KILL_BOUND_S = 10.0  # a SIGKILLed stage: affected requests have ended
# A stopped stage with pending work: /health 503 and errors, once steps were timed: the stall
# bound is then its floor (step_timeout_floor_s, 5 s; 10 x p99 step time is far less), not the
# ceiling (tiny-tp2.yaml's step_timeout_s, 20 s).
STALL_BOUND_S = 10.0
REBUILD_BOUND_S = 90.0  # healthy again and serving (tiny models; real ones: their load time)
LONG = {"prompt": "go", "max_tokens": 240, "ignore_eos": True}
CANARY = {"prompt": "The quick brown fox", "max_tokens": 12, "ignore_eos": True, "logprobs": 1}


base = app_fixture(APP, "tiny-tp2.yaml", {"num_slots": NUM_SLOTS, "max_waiting": 16})


@pytest.fixture(scope="module")
def canary(base):
    out = completion(base, CANARY)
    assert out.ok and len(out.tokens[0]) == 12
    return out


def start_load(base: str, pool: ThreadPoolExecutor) -> list:
    """A stream, a 2-choice stream and a JSON request, all long; returns once both streams have
    output (the JSON one is then running too)."""
    firsts = [threading.Event(), threading.Event()]
    futures = [
        pool.submit(completion, base, {**LONG, "stream": True}, first_chunk=firsts[0]),
        pool.submit(completion, base, {**LONG, "stream": True, "n": 2}, first_chunk=firsts[1]),
        pool.submit(completion, base, dict(LONG)),
    ]
    for event in firsts:
        assert event.wait(60)
    return futures


def check_recovered(base: str, canary, before: dict, restarts: int, t_fault: float,
                    replaced: str | None) -> None:
    """Healthy and serving again with the `replaced` stage ("verifiers": every rank, or
    "output") new and every other stage the same process; None: the draft and output actors
    kept, the verifier ranks either all kept or all new."""
    deadline = t_fault + REBUILD_BOUND_S
    while engine_stats(APP)["restarts"] < restarts or \
            httpx.get(f"{base}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, engine_stats(APP)
        time.sleep(0.2)
    after = stage_pids(APP)
    assert after["engine"] == before["engine"]  # the service itself never restarted
    kept = {"draft", "verifiers", "output"} - {replaced or "verifiers"}
    assert {k: after[k] for k in kept} == {k: before[k] for k in kept}, (before, after)
    if replaced is None:
        assert after["verifiers"] == before["verifiers"] or \
            set(after["verifiers"]).isdisjoint(before["verifiers"]), (before, after)
    elif replaced == "verifiers":
        assert set(after["verifiers"]).isdisjoint(before["verifiers"])
    else:
        assert after[replaced] != before[replaced]
    wait_slots_free(APP, NUM_SLOTS)
    again = completion(base, CANARY)
    assert again.ok and (again.text, again.tokens) == (canary.text, canary.tokens)


def check_failed_requests(futures: list, bound: float, t_fault: float) -> None:
    for f in futures:
        out = f.result(timeout=bound + 30)
        out.check_one_terminal_each()
        assert out.error is not None, out  # none of these long requests could have finished
        assert out.status == 503 or (out.status == 200 and out.done), out
        assert out.error["code"] == "engine_unavailable", out.error
    assert time.monotonic() - t_fault < bound


def test_sigkill_of_the_draft_actor_mid_generation_costs_nothing(base, canary):
    before = stage_pids(APP)
    restarts = engine_stats(APP)["restarts"]
    want = completion(base, dict(LONG))  # greedy: the output every choice gives, fault or not
    assert want.ok
    with ThreadPoolExecutor(4) as pool:
        futures = start_load(base, pool)
        watch = HealthWatch(base)
        t_fault = time.monotonic()
        os.kill(before["draft"], signal.SIGKILL)
        try:
            outs = [f.result(timeout=120) for f in futures]
            deadline = t_fault + REBUILD_BOUND_S
            while stage_pids(APP)["draft"] == before["draft"]:  # the new one answered
                assert time.monotonic() < deadline, engine_stats(APP)
                time.sleep(0.2)
        finally:
            watch.close()
    for out in outs:
        out.check_one_terminal_each()
        assert out.ok, out
        assert all(out.text[i] == want.text[0] for i in range(out.n)), out
        assert all(out.terminal[i] == ["length"] for i in range(out.n)), out
    assert set(watch.statuses()) == {200}, watch.reasons
    stats = engine_stats(APP)
    assert stats["restarts"] == restarts and stats["draft_live"] and stats["draft_losses"] >= 1
    after = stage_pids(APP)
    assert (after["engine"], after["verifiers"], after["output"]) == \
        (before["engine"], before["verifiers"], before["output"])
    wait_slots_free(APP, NUM_SLOTS)
    again = completion(base, CANARY)
    assert again.ok and (again.text, again.tokens) == (canary.text, canary.tokens)


@pytest.mark.parametrize("victim", ["verifier", "output"])
def test_sigkill_of_a_stage_mid_generation_errors_fast_then_the_engine_rebuilds(
        base, canary, victim):
    before = stage_pids(APP)
    restarts = engine_stats(APP)["restarts"]
    pid = {"verifier": before["verifiers"][1], "output": before["output"]}[victim]
    with ThreadPoolExecutor(4) as pool:
        futures = start_load(base, pool)
        watch = HealthWatch(base)
        t_fault = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        try:
            check_failed_requests(futures, KILL_BOUND_S, t_fault)
            check_recovered(base, canary, before, restarts + 1, t_fault,
                            "verifiers" if victim == "verifier" else "output")
        finally:
            watch.close()
    assert watch.first_503 is not None and watch.first_503 - t_fault < KILL_BOUND_S
    assert watch.back_200 is not None
    print(f"{victim} SIGKILL: /health 200 again {watch.back_200 - t_fault:.2f}s after it")


def test_sigkill_of_an_idle_output_actor_is_noticed_by_health_and_rebuilt(base, canary):
    before = stage_pids(APP)
    restarts = engine_stats(APP)["restarts"]
    watch = HealthWatch(base)
    t_fault = time.monotonic()
    os.kill(before["output"], signal.SIGKILL)
    try:
        check_recovered(base, canary, before, restarts + 1, t_fault, "output")
    finally:
        watch.close()
    assert watch.first_503 is not None and watch.first_503 - t_fault < KILL_BOUND_S


def test_sigstop_of_a_verifier_rank_turns_health_503_then_the_engine_rebuilds(base, canary):
    before = stage_pids(APP)
    restarts = engine_stats(APP)["restarts"]
    pid = before["verifiers"][0]
    with ThreadPoolExecutor(4) as pool:
        futures = start_load(base, pool)
        deadline = time.monotonic() + 60  # this engine timed enough steps to adapt its bound
        while engine_stats(APP)["stall_bound_s"] > 5.0:
            assert time.monotonic() < deadline, engine_stats(APP)
            time.sleep(0.1)
        watch = HealthWatch(base)
        t_fault = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            check_failed_requests(futures, STALL_BOUND_S, t_fault)
            while watch.first_503 is None and time.monotonic() - t_fault < STALL_BOUND_S:
                time.sleep(0.05)
            assert watch.first_503 is not None and watch.first_503 - t_fault < STALL_BOUND_S
        finally:
            try:
                os.kill(pid, signal.SIGCONT)  # the rebuild may have killed it already
            except ProcessLookupError:
                pass
        try:
            # the rank resumed before its reset's wait ran out is kept, else all are replaced
            check_recovered(base, canary, before, restarts + 1, t_fault, None)
        finally:
            watch.close()
