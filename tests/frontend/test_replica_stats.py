"""Several engine replicas as one: merged stats (sums right, per-replica snapshots kept), health
while any replica serves, and /metrics series labelled by replica whose sums are the totals."""

from __future__ import annotations

from pipeline.frontend.metrics import ServerMetrics
from pipeline.frontend.replica_stats import merge_health, merge_stats


def snapshot(steps: int, running: int, healthy: bool = True, **extra) -> dict:
    return {"steps": steps, "running": running, "free_slots": 2 - running, "num_slots": 2,
            "healthy": healthy, "num_draft_tokens": 10 * steps, "num_accepted_tokens": 5 * steps,
            "acceptance_histogram": [steps, 1], "k_chosen": [0, steps],
            "prefix_cache_hits": 16 * steps, "stall_bound_s": 1.0 + steps,
            "step_seconds": {"buckets": [0.1, 1.0], "counts": [steps, 0, 1], "sum": 0.5},
            **extra}


def test_merged_stats_sum_counters_gauges_and_histograms():
    merged = merge_stats({"r1": snapshot(3, 1), "r2": snapshot(4, 2, acceptance_histogram=[1])})
    assert (merged["steps"], merged["running"], merged["free_slots"], merged["num_slots"]) == \
        (7, 3, 1, 4)
    assert merged["prefix_cache_hits"] == 16 * 7
    assert merged["acceptance_histogram"] == [4, 1]
    assert merged["step_seconds"] == {"buckets": [0.1, 1.0], "counts": [7, 0, 2], "sum": 1.0}
    assert merged["stall_bound_s"] == 5.0  # the worst, not a sum
    assert merged["healthy"] is True
    assert merged["replicas"]["r2"]["steps"] == 4


def test_health_holds_while_any_replica_is_healthy():
    one_down = merge_health({"r1": {"healthy": True}, "r2": {"healthy": False, "reason": "dead"}})
    assert one_down["healthy"] is True and one_down["replicas_healthy"] == 1
    assert "r2: dead" in one_down["reason"]
    assert merge_health({"r1": {"healthy": False}})["healthy"] is False
    assert merge_health({}) == {"healthy": False, "reason": "no engine replica is running"}
    assert merge_stats({"r1": snapshot(1, 0, healthy=False)})["healthy"] is False


def test_metrics_show_every_replica_with_a_replica_label_and_the_sums_are_right():
    m = ServerMetrics("tiny")
    m.update_engine_stats(merge_stats({"r1": snapshot(3, 1), "r2": snapshot(4, 2)}))
    text = m.render().decode()
    assert 'specrelay_engine_steps_total{model="tiny",replica="r1"} 3.0' in text
    assert 'specrelay_engine_steps_total{model="tiny",replica="r2"} 4.0' in text
    assert 'specrelay_num_requests_running{model="tiny",replica="r2"} 2.0' in text
    assert 'specrelay_prefix_cache_hits_total{model="tiny",replica="r1"} 48.0' in text
    assert 'specrelay_spec_acceptance_rate{model="tiny",replica="r1"} 0.5' in text
    assert 'specrelay_spec_k_chosen_count{model="tiny",replica="r2"} 4.0' in text
    assert 'specrelay_spec_verify_step_seconds_count{model="tiny",replica="r1"} 4.0' in text
    steps = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("specrelay_engine_steps_total{")]
    assert sum(steps) == 7.0  # no unlabelled total beside the series (it would count twice)
    # one engine, no replicas mapping: the model label only, as before
    m.update_engine_stats(snapshot(5, 0))
    assert 'specrelay_engine_steps_total{model="tiny"} 5.0' in m.render().decode()
