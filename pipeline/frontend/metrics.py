"""Prometheus metrics of the HTTP front end, in a registry of their own: what the server observes
per request, and the engine's `stats()` snapshot (copied in before each scrape and exported by a
collector, since the engine owns and counts those values)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "specrelay"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


# (metric name, engine stats key, help)
ENGINE_GAUGES = (
    ("num_requests_running", "running", "Requests holding an engine slot."),
    ("num_requests_waiting", "waiting", "Requests queued for a slot."),
    ("num_free_slots", "free_slots", "Engine slots not in use."),
    ("num_slots", "num_slots", "Engine slots in all."),
    ("max_waiting", "max_waiting", "Places in the wait queue (beyond them: 429)."),
)
ENGINE_COUNTERS = (
    ("engine_steps", "steps", "Engine steps run."),
    ("spec_dropped_steps", "dropped_steps",
     "Steps dropped whole because their request had already finished or was aborted."),
    ("spec_decode_num_verify_steps", "verify_steps",
     "Request-steps after the prefill (each verifies, drafted or not)."),
    # vLLM's spec-decode counters (vllm:spec_decode_num_*): raw, before finish truncation.
    ("spec_decode_num_drafts", "num_drafts", "Request-steps with at least one draft."),
    ("spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens proposed."),
    ("spec_decode_num_accepted_tokens", "num_accepted_tokens",
     "Draft tokens accepted by the verifier."),
    ("engine_stall_detections", "stalls",
     "Steps declared stalled (each fails the engine's in-flight requests)."),
    ("engine_restarts", "restarts", "Engine rebuilds after a failure (stage actors replaced)."),
    # vLLM's prefix-cache counters, in prompt tokens
    ("prefix_cache_queries", "prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache (first prefills)."),
    ("prefix_cache_hits", "prefix_cache_hits",
     "Prompt tokens whose KV came from the prefix cache."),
    ("num_preemptions", "preemptions",
     "Requests preempted (KV pool full) and later recomputed."),
    ("spec_decode_hidden_state_bytes", "hidden_state_bytes",
     "Bytes of the target's hidden states sent on to an EAGLE-3 draft stage."),
    ("engine_steps_ahead", "steps_ahead",
     "Steps planned and sent while the step before them ran (async scheduling)."),
)


class _EngineStatsCollector(Collector):
    """A snapshot with a `replicas` mapping gives one series per replica (label `replica`), whose
    sum() is the deployment's total."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterable[Metric]:
        if not self.stats:
            return
        replicas = self.stats.get("replicas")
        if replicas:
            self._labels = ["model", "replica"]
            self._series = [([self.model, str(r)], s) for r, s in sorted(replicas.items())]
        else:
            self._labels, self._series = ["model"], [([self.model], self.stats)]
        yield from self._engine()
        yield from self._speculation()

    def _each(self, family: type, name: str, doc: str, value: Any) -> Metric:
        metric = family(f"{PREFIX}_{name}", doc, labels=self._labels)
        for labels, s in self._series:
            metric.add_metric(labels, float(value(s)))
        return metric

    def _engine(self) -> Iterable[Metric]:
        for name, key, doc in ENGINE_GAUGES:
            yield self._each(GaugeMetricFamily, name, doc, lambda s, k=key: s.get(k) or 0)
        yield self._each(GaugeMetricFamily, "engine_healthy", "1 when the engine is healthy.",
                         lambda s: 1.0 if s.get("healthy", False) else 0.0)
        yield self._each(GaugeMetricFamily, "kv_cache_usage_perc",
                         "Share of the KV block pool the running requests hold (0..1).",
                         kv_usage)
        for name, key, doc in ENGINE_COUNTERS:
            yield self._each(CounterMetricFamily, name, doc, lambda s, k=key: s.get(k) or 0)

    def _speculation(self) -> Iterable[Metric]:
        per_pos = CounterMetricFamily(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts whose token at this position was accepted.",
                                      labels=[*self._labels, "position"])
        for labels, s in self._series:
            for pos, n in enumerate(s.get("num_accepted_tokens_per_pos") or []):
                per_pos.add_metric([*labels, str(pos)], float(n))
        yield per_pos
        yield self._each(GaugeMetricFamily, "spec_acceptance_rate",
                         "Accepted / drafted tokens since start (pooled counts).", acceptance_rate)
        yield self._each(GaugeMetricFamily, "spec_mean_accepted_length",
                         "Tokens per verify step, drafted or not (accepted drafts + 1).",
                         tokens_per_verify)
        yield from self._histogram(
            "spec_acceptance_length", "Accepted draft tokens per verify step (raw).",
            lambda s: [(str(float(i)), c) for i, c in enumerate(acceptance_histogram(s))],
            lambda s: sum(i * c for i, c in enumerate(acceptance_histogram(s))))
        yield from self._histogram(
            "spec_k_chosen", "Drafts given per verify request-step (k chosen; 0: none drafted).",
            lambda s: [(str(float(k)), c) for k, c in enumerate(s.get("k_chosen") or [])],
            lambda s: sum(k * c for k, c in enumerate(s.get("k_chosen") or [])))
        yield from self._histogram(
            "spec_verify_step_seconds", "Seconds one decode step took to draft and verify.",
            step_buckets, lambda s: float((s.get("step_seconds") or {}).get("sum", 0.0)))

    def _histogram(self, name: str, doc: str, per_bucket: Any, total: Any) -> Iterable[Metric]:
        """From per-bucket (not cumulative) counts; no family when no series has counts."""
        h = HistogramMetricFamily(f"{PREFIX}_{name}", doc, labels=self._labels)
        for labels, s in self._series:
            buckets_of = per_bucket(s)
            if not buckets_of:
                continue
            if buckets_of[-1][0] != "+Inf":
                buckets_of = [*buckets_of, ("+Inf", 0)]
            buckets, running = [], 0
            for bound, count in buckets_of:
                running += count
                buckets.append((bound, float(running)))
            h.add_metric(labels, buckets, sum_value=float(total(s)))
        if h.samples:
            yield h


def kv_usage(stats: dict[str, Any]) -> float:
    blocks = float(stats.get("kv_blocks") or 0)
    return float(stats.get("kv_blocks_used") or 0) / blocks if blocks else 0.0


def acceptance_rate(stats: dict[str, Any]) -> float:
    drafted = float(stats.get("num_draft_tokens") or 0)
    return float(stats.get("num_accepted_tokens") or 0) / drafted if drafted else 0.0


def step_buckets(stats: dict[str, Any]) -> list[tuple[str, int]]:
    timing = stats.get("step_seconds") or {}
    if not timing:
        return []
    return ([(str(float(b)), c) for b, c in zip(timing["buckets"], timing["counts"])]
            + [("+Inf", timing["counts"][-1])])


def tokens_per_verify(stats: dict[str, Any]) -> float:
    hist = acceptance_histogram(stats)
    steps = sum(hist)
    return sum(i * c for i, c in enumerate(hist)) / steps + 1.0 if steps else 0.0


def acceptance_histogram(stats: dict[str, Any]) -> list[int]:
    raw = stats.get("acceptance_histogram", stats.get("spec_acceptance_histogram", []))
    if isinstance(raw, dict):  # {accepted_len: count}, possibly with string keys
        pairs = {int(k): int(v) for k, v in raw.items()}
        return [pairs.get(i, 0) for i in range(max(pairs, default=-1) + 1)]
    return [int(c) for c in raw or []]


class ServerMetrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model"]
        self.http_requests = Counter(f"{PREFIX}_http_requests",
                                     "HTTP requests by route and status.", ["route", "status"],
                                     registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed.", m,
                                     registry=r)
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens",
            "Generated (retained) tokens; rate() of this is tokens per second.", m, registry=r)
        self.request_finished = Counter(f"{PREFIX}_request_finished", "Finished choices by reason.",
                                        ["model", "finish_reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time from request arrival to its first output token.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Time between output deltas divided by the tokens in the delta.", m,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "Time from request arrival to its last output token.", m,
                             buckets=E2E_BUCKETS, registry=r)
        self.retained_accepted = Histogram(
            f"{PREFIX}_request_accepted_tokens",
            "Accepted draft tokens per finished request (after finish truncation).", m,
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r)
        # After finish truncation, as clients were given them: acceptance = accepted / draft.
        self.retained_draft_tokens = Counter(
            f"{PREFIX}_request_spec_draft_tokens",
            "Draft tokens of finished requests (their spec_stats.draft_tokens).", m, registry=r)
        self.retained_accepted_tokens = Counter(
            f"{PREFIX}_request_spec_accepted_tokens",
            "Accepted draft tokens of finished requests (their spec_stats.accepted_tokens).", m,
            registry=r)
        self._engine = _EngineStatsCollector(model)
        r.register(self._engine)

    def set_model(self, model: str) -> None:
        self.model = self._engine.model = model

    def update_engine_stats(self, stats: dict[str, Any]) -> None:
        self._engine.stats = dict(stats)

    def engine_unreachable(self) -> None:
        # Last counters kept; a stale "healthy" would hide a wedged engine from the alerts.
        self._engine.stats = {**self._engine.stats, "healthy": False}

    def observe_http(self, route: str, status: int) -> None:
        self.http_requests.labels(route, str(status)).inc()

    def observe_prompt(self, n_tokens: int) -> None:
        self.prompt_tokens.labels(self.model).inc(n_tokens)

    def observe_delta(self, n_tokens: int, since_request: float, since_last: float | None) -> None:
        """`since_last` is None for the request's first delta."""
        if n_tokens <= 0:
            return
        self.generation_tokens.labels(self.model).inc(n_tokens)
        if since_last is None:
            self.ttft.labels(self.model).observe(since_request)
        else:
            # A speculative step delivers several tokens at once; spread the gap over them.
            per_token = since_last / n_tokens
            hist = self.itl.labels(self.model)
            for _ in range(n_tokens):
                hist.observe(per_token)

    def observe_finish(self, finish_reason: str | None, latency: float,
                       accepted_tokens: int, draft_tokens: int = 0) -> None:
        self.request_finished.labels(self.model, finish_reason or "error").inc()
        self.e2e.labels(self.model).observe(latency)
        self.retained_accepted.labels(self.model).observe(accepted_tokens)
        self.retained_accepted_tokens.labels(self.model).inc(accepted_tokens)
        self.retained_draft_tokens.labels(self.model).inc(draft_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
