"""One cell's result (a mode, workload and batch size) from its segments: the waves it ran, per
repetition, with what each cost and what the engine counted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from scripts.engine_bench.stages import StageTimes
from scripts.engine_bench.traces import Trace, busy_window, latency_stats
from scripts.harness import percentile, spread


@dataclass
class RunResult:
    engine: str  # local | ray | hf
    mode: str  # none | ngram | model | hf | hf-pld
    workload: str
    batch: int
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float  # median over repetitions of all tokens / the whole wall time
    requests_per_s: float
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None  # gaps between a stream's deltas (one delta per step)
    itl_p99_ms: float | None = None
    tpot_ms: float | None = None  # mean over requests of (last - first delta) / (tokens - 1)
    steps: int = 0
    mean_accepted_len: float | None = None  # tokens per verify (accepted drafts + 1)
    acceptance_rate: float | None = None  # accepted drafts / drafted tokens
    histogram: list[int] = field(default_factory=list)  # verifies by accepted drafts
    cpu_s: float = 0.0
    tokens_per_cpu_s: float = 0.0
    rep_tokens_per_s: list[float] = field(default_factory=list)  # one per repetition
    # the same over only the time the client still had requests to submit (the batch full, no
    # drain); None where every request was submitted at once (one wave: nothing but drain)
    busy_tokens_per_s: float | None = None
    rep_busy_tokens_per_s: list[float] = field(default_factory=list)
    spread: float | None = None  # (max - min) / median of rep_tokens_per_s
    cores: int | None = None  # Ray: CPUs Ray was given
    stats_violations: list[str] = field(default_factory=list)  # requests breaking the identity
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # per step
    ray_vs_local: dict[str, float] = field(default_factory=dict)  # ray runs: local, interleaved
    outside_forward_frac: float | None = None  # step time not in a model forward
    outputs: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Segment:
    """One wave of one mode: what it produced and what it cost."""

    traces: list[Trace]
    wall: float
    cpu: float  # this process's CPU seconds (steadier than wall on a shared machine)
    spec: dict[str, Any] | None = None
    times: StageTimes | None = None


SPEC_KEYS = ("steps", "verify_steps", "num_draft_tokens", "num_accepted_tokens")


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    hist_b, hist_a = before["histogram"], after["histogram"]
    hist = [n - (hist_b[i] if i < len(hist_b) else 0) for i, n in enumerate(hist_a)]
    return {k: after[k] - before[k] for k in SPEC_KEYS} | {"histogram": hist}


def snapshot(stats: Any) -> dict[str, Any]:
    """The engine's raw counters, from `stats_dict()` (Ray) or an EngineStats (in-process)."""
    if not isinstance(stats, dict):
        stats = {"steps": stats.steps, "verify_steps": stats.verify_steps,
                 "num_draft_tokens": stats.draft_tokens,
                 "num_accepted_tokens": stats.accepted_tokens,
                 "acceptance_histogram": stats.histogram}
    return {k: stats[k] for k in SPEC_KEYS} | {
        "histogram": list(stats.get("acceptance_histogram", []))}


def merge(engine: str, mode: str, workload: str, batch: int,
          reps: list[list[Segment]]) -> RunResult:
    """One RunResult from a mode's segments, per repetition (interleaved with the other modes'):
    tok/s is the median over repetitions, totals are over all of them."""
    segs = [s for r in reps for s in r]
    traces = [t for s in segs for t in s.traces]
    wall, cpu = sum(s.wall for s in segs), sum(s.cpu for s in segs)
    tokens = sum(len(t.token_ids) for t in traces)
    rates = [sum(len(t.token_ids) for s in r for t in s.traces) / sum(s.wall for s in r)
             for r in reps]
    median = percentile(rates, 50) or 0.0
    busy = [[busy_window(s.traces) for s in r] for r in reps]
    # one wave (every request submitted at once) has no busy window: nothing to report
    busy_rates = [sum(n for n, _ in b) / sum(w for _, w in b) for b, r in zip(busy, reps)
                  if sum(w for _, w in b) > 0.05 * sum(s.wall for s in r)]
    if len(busy_rates) < len(reps):
        busy_rates = []
    res = RunResult(engine, mode, workload, batch, len(traces), tokens, wall, median,
                    len(traces) / wall, cpu_s=cpu, tokens_per_cpu_s=tokens / max(cpu, 1e-9),
                    rep_tokens_per_s=rates, rep_busy_tokens_per_s=busy_rates,
                    busy_tokens_per_s=percentile(busy_rates, 50),
                    spread=spread(rates),
                    **latency_stats(traces), outputs={t.rid: t.token_ids for t in traces})
    res.stats_violations = [
        f"{t.rid}: {len(t.token_ids)} tokens != 1 + {t.spec[0]} + {t.spec[1]}"
        for t in traces if t.spec is not None and len(t.token_ids) != 1 + t.spec[0] + t.spec[1]]
    specs = [s.spec for s in segs if s.spec is not None]
    if specs:
        spec = {k: sum(x[k] for x in specs) for k in SPEC_KEYS}
        width = max(len(x["histogram"]) for x in specs)
        spec["histogram"] = [sum(x["histogram"][i] for x in specs if i < len(x["histogram"]))
                             for i in range(width)]
        res.steps = spec["steps"]
        res.histogram = spec["histogram"]
        if spec["verify_steps"]:  # every decode step, drafted or not
            res.mean_accepted_len = spec["num_accepted_tokens"] / spec["verify_steps"] + 1
        if spec["num_draft_tokens"]:
            res.acceptance_rate = spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    times = [s.times for s in segs if s.times is not None]
    if times:
        total = StageTimes()
        for t in times:
            for f in dataclasses.fields(StageTimes):
                setattr(total, f.name, getattr(total, f.name) + getattr(t, f.name))
        add_breakdown(res, total)
    return res


def add_breakdown(res: RunResult, t: StageTimes) -> None:
    steps = max(res.steps, 1)
    parts = {
        "draft_forward": t.draft_forward,
        "draft_other": t.draft - t.draft_forward,
        "verify_forward": t.verify_forward,
        "verify_other": t.verify - t.verify_forward,
        "output": t.output,
        "other": res.wall_s - t.draft - t.verify - t.output,
    }
    res.breakdown_ms = {k: v * 1e3 / steps for k, v in parts.items()}
    res.breakdown_ms["step"] = res.wall_s * 1e3 / steps
    res.outside_forward_frac = 1 - (t.draft_forward + t.verify_forward) / res.wall_s
