"""The Grafana dashboard, as data: rows of panels over the /metrics series. Queries use only
Prometheus and the variables `$datasource` and `$__rate_interval` (tests/ops evaluates each one
against a real Prometheus); docs/operations.md explains the panels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

UID = "specrelay-overview"
TITLE = "specrelay: speculative decoding serving"
R = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat
    max: float | None = None


def rate(metric: str, by: str = "", window: str = R) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}[{window}]))"


def quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{R}])))"


def p50_p99(metric: str) -> tuple[tuple[str, str], ...]:
    return ((quantile(0.5, metric), "p50"), (quantile(0.99, metric), "p99"))


ACCEPTED = "specrelay_spec_decode_num_accepted_tokens_total"
DRAFTED = "specrelay_spec_decode_num_draft_tokens_total"
DRAFTS = "specrelay_spec_decode_num_drafts_total"
VERIFY_STEPS = "specrelay_spec_decode_num_verify_steps_total"
HTTP = "specrelay_http_requests_total"
KEPT_ACCEPTED = "specrelay_request_spec_accepted_tokens_total"  # finished requests' spec_stats
KEPT_DRAFTED = "specrelay_request_spec_draft_tokens_total"
PER_POS = "specrelay_spec_decode_num_accepted_tokens_per_pos_total"
K = "specrelay_spec_k_chosen"
K_ZERO = K + '_bucket{le="0.0"}'

SPECULATION = (
    Panel("Acceptance rate (pooled)",
          "Accepted draft tokens / drafted tokens, pooled over all requests. 'spec_stats' counts "
          "what finished requests kept (their responses' spec_stats); 'verifier' counts every "
          "verify step before finish truncation.",
          ((f"{rate(KEPT_ACCEPTED)} / {rate(KEPT_DRAFTED)}", "spec_stats"),
           (f"{rate(ACCEPTED)} / {rate(DRAFTED)}", "verifier")),
          unit="percentunit", max=1),
    Panel("Acceptance since start (pooled spec_stats)",
          "sum accepted_tokens / sum draft_tokens of every finished request's spec_stats since "
          "the servers started: the number a client would compute from the responses.",
          ((f"sum({KEPT_ACCEPTED}) / sum({KEPT_DRAFTED})", "acceptance"),),
          unit="percentunit", kind="stat", max=1),
    Panel("Acceptance by draft position",
          "Share of drafts whose token at this position was accepted (position 0 first). A fall "
          "at every position: the draft no longer matches the target (model or prompt change).",
          ((f"{rate(PER_POS, 'position')} / ignoring(position) group_left {rate(DRAFTS)}",
            "position {{position}}"),),
          unit="percentunit", max=1),
    Panel("Tokens per verify step",
          "Tokens each verify step gave a request (accepted drafts + the target's own token): "
          "1.0 means speculation saves nothing.",
          ((f"1 + {rate(ACCEPTED)} / {rate(VERIFY_STEPS)}", "tokens / verify"),)),
    Panel("Drafted vs kept tokens",
          "Draft tokens proposed and accepted per second (the gap is wasted verify work).",
          ((rate(DRAFTED), "drafted"), (rate(ACCEPTED), "kept (accepted)")), unit="short"),
    Panel("k chosen per step",
          "Drafts given to a request per verify step (the adaptive controller's choice, capped "
          "by num_speculative_tokens and the request's remaining tokens): mean, and the share "
          "of steps at k = 0.",
          ((f"{rate(K + '_sum')} / {rate(K + '_count')}", "mean k"),
           (f"{rate(K_ZERO)} / {rate(K + '_count')}", "share k = 0"))),
    Panel("Steps verified with no drafts",
          "Request-steps verified with nothing drafted per second (k = 0: the controller or the "
          "request's cap chose no drafts, or the proposer had none).",
          ((f"{rate(VERIFY_STEPS)} - {rate(DRAFTS)}", "no drafts"),
           (rate(VERIFY_STEPS), "all verify steps"))),
    Panel("Verify step time",
          "Seconds a decode step took to draft and verify (steps without a prefill).",
          p50_p99("specrelay_spec_verify_step_seconds"), unit="s"),
)

SERVING = (
    Panel("Request rate by route",
          "HTTP requests per second by route (every status).",
          ((rate(HTTP, "route"), "{{route}}"),), unit="reqps"),
    Panel("Time to first token", "Arrival to first output token.",
          p50_p99("specrelay_time_to_first_token_seconds"), unit="s"),
    Panel("Inter-token latency", "Gap between output deltas per token in the delta.",
          p50_p99("specrelay_inter_token_latency_seconds"), unit="s"),
    Panel("End-to-end latency", "Arrival to the last output token.",
          p50_p99("specrelay_e2e_request_latency_seconds"), unit="s"),
    Panel("Queue",
          "Requests running (holding a slot) and waiting for one, with the queue's capacity.",
          (("sum(specrelay_num_requests_running)", "running"),
           ("sum(specrelay_num_requests_waiting)", "waiting"),
           ("sum(specrelay_max_waiting)", "waiting capacity"))),
    Panel("Slot use",
          "Share of engine slots in use (1 - free / all).",
          (("1 - sum(specrelay_num_free_slots) / sum(specrelay_num_slots)", "slots used"),),
          unit="percentunit", max=1),
    Panel("Generated tokens", "Retained output tokens per second.",
          ((rate("specrelay_generation_tokens_total"), "tokens/s"),)),
    Panel("Finish reasons", "Finished choices per second by finish reason.",
          ((rate("specrelay_request_finished_total", "finish_reason"), "{{finish_reason}}"),),
          unit="reqps"),
    Panel("Errors by status (4xx / 5xx)",
          "HTTP responses with a 4xx or 5xx status per second, by status code.",
          ((rate(HTTP + '{status=~"4..|5.."}', "status"), "{{status}}"),), unit="reqps"),
)

ENGINE = (
    Panel("Engine health",
          "1 per server whose engine reports healthy (0: dead, stalled or rebuilding).",
          (("specrelay_engine_healthy", "{{instance}}"),), max=1),
    Panel("Healthy engines", "Servers whose engine is healthy.",
          (("sum(specrelay_engine_healthy)", "healthy"),), kind="stat"),
    Panel("Engine restarts", "Engine rebuilds after a failure (stage actors replaced), per hour.",
          (("sum by (instance) (increase(specrelay_engine_restarts_total[1h]))",
            "{{instance}}"),)),
    Panel("Stall detections",
          "Steps declared stalled per hour (each fails the in-flight requests and rebuilds).",
          (("sum by (instance) (increase(specrelay_engine_stall_detections_total[1h]))",
            "{{instance}}"),)),
    Panel("Engine steps", "Engine steps per second, and steps dropped after a finish.",
          ((rate("specrelay_engine_steps_total"), "steps"),
           (rate("specrelay_spec_dropped_steps_total"), "dropped steps"))),
    Panel("KV cache usage",
          "Share of the KV block pool the running requests hold, per server (cached prefix "
          "blocks nobody holds are reusable and not counted).",
          (("specrelay_kv_cache_usage_perc", "{{instance}}"),), unit="percentunit", max=1),
    Panel("Prefix cache hit rate",
          "Prompt tokens whose KV came from the prefix cache / prompt tokens looked up.",
          (((f"{rate('specrelay_prefix_cache_hits_total')} / "
            f"{rate('specrelay_prefix_cache_queries_total')}"), "hit rate"),),
          unit="percentunit", max=1),
    Panel("Preemptions",
          "Requests preempted per second because the KV pool ran out (each is recomputed).",
          ((rate("specrelay_num_preemptions_total"), "preemptions"),), unit="reqps"),
)

ROWS = (("Speculation", SPECULATION), ("Serving", SERVING), ("Replica / engine", ENGINE))


def queries() -> list[str]:
    return [expr for _, panels in ROWS for p in panels for expr, _ in p.targets]


def _panel(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": p.unit}
    if p.max is not None:
        defaults |= {"min": 0, "max": p.max}
    return {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description,
        "datasource": DATASOURCE, "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
        if p.kind == "timeseries" else {"reduceOptions": {"calcs": ["lastNotNull"]}},
        "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "refId": chr(ord("A") + i)} for i, (expr, legend) in enumerate(p.targets)],
    }


def dashboard() -> dict[str, Any]:
    """Grafana's schema, version 39."""
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        for i, p in enumerate(row):
            panels.append(_panel(p, len(panels) + 1, 8 * (i % 3), y + 8 * (i // 3)))
        y += 8 * ((len(row) + 2) // 3)
    return {
        "uid": UID, "title": TITLE, "tags": ["specrelay", "llm", "speculative-decoding"],
        "schemaVersion": 39, "version": 1, "editable": True, "timezone": "",
        "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0}]},
        "annotations": {"list": []}, "links": [], "panels": panels,
    }
