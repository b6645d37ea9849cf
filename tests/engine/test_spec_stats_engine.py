"""Speculative statistics end to end in the in-process engine: the per-request identity holds for
every request (stops and truncated windows included) and the per-request sums equal the
Prometheus counters the front end exports."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.config import load_config
from pipeline.engine.local import build_local_engine, collect
from pipeline.frontend.metrics import ServerMetrics
from pipeline.params import SamplingParams

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = "configs/tiny.yaml"
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [3] * 20, [77, 78, 77, 78, 77], [100, 101]]


def _run(overrides: dict, requests: list) -> tuple[dict, dict]:
    core = build_local_engine(load_config(CONFIG, overrides))

    async def go() -> tuple[dict, dict]:
        done = await collect(core, requests)
        return done, await core.stats_dict()

    return asyncio.run(go())


@pytest.mark.parametrize("draft", ["ngram", "model"])
@pytest.mark.parametrize("speculation", ["fixed", "adaptive"])
def test_every_request_satisfies_the_statistics_identity(draft, speculation):
    reqs = []
    for i in range(8):
        p = PROMPTS[i % len(PROMPTS)]
        reqs.append((f"r{i}", p, SamplingParams(
            max_new_tokens=10 + 3 * i, stop=[chr(p[0])] if i % 3 == 1 else [],
            stop_token_ids=[p[-1]] if i % 3 == 2 else [])))
    done, _ = _run({"draft": draft, "speculation": speculation}, reqs)
    for c in done.values():
        last = c.last
        assert len(c.token_ids) == 1 + last.spec_verify_ct + last.spec_accepted_tokens
        assert sum(last.spec_acceptance_histogram) == last.spec_verify_ct
        assert last.spec_accepted_tokens <= last.spec_draft_tokens


def _counters(stats: dict) -> dict[str, float]:
    metrics = ServerMetrics("m")
    metrics.update_engine_stats(stats)
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            key = s.name + "".join(f"[{v}]" for k, v in s.labels.items() if k == "position")
            out[key] = s.value
    return out


def test_per_request_sums_equal_the_prometheus_counters():
    # No stop rule can cut a window (EOS ignored, drafts are capped at the length limit), so the
    # retained per-request statistics and the engine's raw counters count the same tokens.
    reqs = [(f"r{i}", PROMPTS[i % len(PROMPTS)],
             SamplingParams(max_new_tokens=12 + 5 * i, ignore_eos=True)) for i in range(6)]
    done, stats = _run({"draft": "ngram", "speculation": "fixed"}, reqs)
    lasts = [c.last for c in done.values()]
    m = _counters(stats)
    drafts = sum(x.spec_draft_tokens for x in lasts)
    accepted = sum(x.spec_accepted_tokens for x in lasts)
    assert drafts > 0 and accepted > 0
    assert m["specrelay_spec_decode_num_draft_tokens_total"] == drafts
    assert m["specrelay_spec_decode_num_accepted_tokens_total"] == accepted
    assert m["specrelay_spec_decode_num_verify_steps_total"] == sum(x.spec_verify_ct for x in lasts)
    per_pos = [m[k] for k in sorted(m) if k.startswith(
        "specrelay_spec_decode_num_accepted_tokens_per_pos_total[")]
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # position i needs i-1 accepted
    hist = [0] * max(len(x.spec_acceptance_histogram) for x in lasts)
    for x in lasts:
        for i, n in enumerate(x.spec_acceptance_histogram):
            hist[i] += n
    assert stats["acceptance_histogram"] == hist


def test_operator_series_k_chosen_step_time_stalls_and_restarts_are_exported():
    reqs = [(f"r{i}", PROMPTS[i % len(PROMPTS)],
             SamplingParams(max_new_tokens=10 + 4 * i, ignore_eos=True)) for i in range(4)]
    done, stats = _run({"draft": "ngram", "speculation": "fixed"}, reqs)
    m = _counters(stats)
    lasts = [c.last for c in done.values()]
    # k chosen per verify request-step: as many observations as verify steps, their sum is the
    # drafted tokens, and the k = 0 bucket is the steps verified with nothing drafted.
    assert m["specrelay_spec_k_chosen_count"] == sum(x.spec_verify_ct for x in lasts)
    assert m["specrelay_spec_k_chosen_sum"] == sum(x.spec_draft_tokens for x in lasts) > 0
    assert m["specrelay_spec_k_chosen_bucket"] == m["specrelay_spec_k_chosen_count"]  # +Inf last
    assert stats["k_chosen"][0] == (m["specrelay_spec_decode_num_verify_steps_total"]
                                    - m["specrelay_spec_decode_num_drafts_total"])
    # every decode-only step was timed, none stalled, the in-process engine never restarts
    assert 0 < m["specrelay_spec_verify_step_seconds_count"] <= stats["steps"]
    assert m["specrelay_spec_verify_step_seconds_sum"] > 0
    assert m["specrelay_engine_stall_detections_total"] == 0
    assert m["specrelay_engine_restarts_total"] == 0


def test_finished_requests_pool_their_spec_stats_into_counters():
    metrics = ServerMetrics("m")
    metrics.observe_finish("stop", 0.5, accepted_tokens=7, draft_tokens=12)
    metrics.observe_finish("length", 0.7, accepted_tokens=3, draft_tokens=4)
    samples = {s.name: s.value for fam in text_string_to_metric_families(metrics.render().decode())
               for s in fam.samples}
    assert samples["specrelay_request_spec_accepted_tokens_total"] == 10
    assert samples["specrelay_request_spec_draft_tokens_total"] == 16
