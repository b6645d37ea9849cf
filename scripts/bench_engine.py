"""End-to-end engine benchmark: modes x workloads x batch sizes on one set of weights, with
Hugging Face `generate` (plain and prompt lookup) as the outside baseline, in one process/run.

    .venv/bin/python scripts/bench_engine.py [--max-tokens 64] [--reps 3] [--plan copy:1,8] ...

Modes: `none` (target only), `adaptive` (n-gram drafts, k chosen per request and step by
pipeline.engine.spec, up to the largest fixed k), `k2` / `k4` / `k8` (n-gram drafts, fixed
k), `model` (a draft model, adaptive), `suffix` (suffix drafts, pipeline.draft.suffix, adaptive
up to SUFFIX_K) and `suffix-fixed` (suffix drafts, k = SUFFIX_K: only the drafts' own score cuts).
SmolLM2-135M has no smaller sibling here, so the `model` draft is a STAND-IN: the target's own
weights with most layers skipped (`--draft-layers`).

Protocol: "batch b" means at most b requests in flight, closed loop as a served engine runs: a
request is submitted the moment another finishes, max(b, `--requests`) requests per repetition
(TTFT never includes queueing: a request's clock starts at its submission). tok/s is all
tokens over the whole wall time of the same work, the drain included: what a batch job of these
requests takes. "busy tok/s" is the rate while the client still had requests to submit (the
batch full; `busy_window`): a drain measures how evenly requests end, not what a step of b
requests yields (at mix batch 8 adaptive finishes the copy requests early and the chat requests
then drain at a smaller batch: 1.28 tokens a verify, only 8% fewer steps); a server under
sustained load runs busy. One-wave cells (b = requests) have no busy window. Every mode runs
the same requests of a cell, the modes interleaved repetition by repetition in a rotated order,
at batch 1 request by request (`interleaved_parts`; `--reps`, >= 3 for numbers worth quoting;
`--reps-b1` for the batch-1 cells, whose segments are short); a cell reports the median of its
repetitions and their spread. CPU time is this
process's (every thread) in-process, and the Ray processes' (the driver's descendants: raylet,
GCS, actors) for the Ray row, labelled with the cores Ray was given. Greedy outputs of every
engine run are compared with an independent reference (target-only, one request at a time,
one token per forward, in-process: `reference_outputs` below, sharing no code with the engine
loop), and every request's statistics must satisfy completion = 1 + verify_ct + accepted.

Writes `<out>/results.json` (with the commit and whether the tree was dirty) and PNG plots; exits 1
(after writing them) when a greedy output differs from the reference or a request breaks the
statistics identity, printing the first case.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `actors`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import yaml

from pipeline.config import is_tiny, load_config, resolve_source
from pipeline.draft.model import DraftModelProposer
from pipeline.draft.step import draft_step
from pipeline.engine.local import LocalStages, build_local_engine
from pipeline.models.llama import LlamaModel
from pipeline.models.runner import ModelRunner
from pipeline.models.runners import build_runner
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall
from pipeline.tokenizer import eos_token_ids
from scripts.tree_state import tree_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD_DIR = os.path.join(ROOT, "scripts", "workloads")
MODES = ("none", "adaptive", "k2", "k4", "k8", "model", "suffix", "suffix-fixed")
FIXED_K = {"k2": 2, "k4": 4, "k8": 8}
SUFFIX_K = 32  # suffix drafts are cut by their own score; this is only the ceiling


# --- workloads ------------------------------------------------------------------------------
@dataclass
class Prompt:
    id: str
    kind: str
    text: str


def load_workload(name: str) -> list[Prompt]:
    """`name` is a file in scripts/workloads (without .jsonl) or a path to a .jsonl file."""
    path = name if name.endswith(".jsonl") else os.path.join(WORKLOAD_DIR, f"{name}.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(r["id"], r.get("kind", "chat"), r["prompt"]) for r in rows]


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Chat-templated ids when the tokenizer has a template, plain bytes otherwise (tiny)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --- timing of the in-process stages -------------------------------------------------------
@dataclass
class StageTimes:
    draft: float = 0.0  # draft_step: proposer bookkeeping + lookup or draft-model forwards
    draft_forward: float = 0.0  # draft-model forwards only
    verify: float = 0.0  # Verifier.step: target forward, acceptance, message encode
    verify_forward: float = 0.0  # target-model forwards only
    output: float = 0.0  # OutputProcessor.process


class Clock:
    """The StageTimes that timed wrappers currently add to (one per benchmark run)."""

    def __init__(self) -> None:
        self.times = StageTimes()

    def wrap_forward(self, runner: Any, attr: str) -> None:
        inner = runner.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                setattr(self.times, attr, getattr(self.times, attr) + time.perf_counter() - t0)

        runner.forward = forward


def timed_stages(clock: Clock) -> Any:
    """A LocalStages subclass adding each stage's time to `clock` (for build_local_engine)."""
    class TimedStages(LocalStages):
        def step(self, plan: Any) -> Any:
            t0 = time.perf_counter()
            proposal = draft_step(self.proposer, plan, self.grammars)
            t1 = time.perf_counter()
            outcome = self.verifier.step(plan, proposal)
            t2 = time.perf_counter()
            clock.times.draft += t1 - t0
            clock.times.verify += t2 - t1
            return outcome

        async def process(self, payload: bytes) -> Any:
            t0 = time.perf_counter()
            out = self.output.process(payload)
            clock.times.output += time.perf_counter() - t0
            return out

    return TimedStages


# --- results ------------------------------------------------------------------------------
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


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Trace:
    """One request as the client saw it."""

    rid: str
    submitted: float
    times: list[float]  # arrival of each delta that carried tokens
    counts: list[int]  # tokens per such delta
    token_ids: list[int]
    spec: tuple[int, int, int] | None = None  # final (verify_ct, accepted, draft tokens)


def busy_window(traces: list[Trace]) -> tuple[int, float]:
    """Tokens delivered while the client still had requests to submit, and that time: from the
    first submission to the last. In a closed loop the batch is full throughout it; after it the
    batch drains, and a drain measures how evenly requests end (a mode that finishes some
    requests sooner runs the rest at a smaller batch), not what a step of b requests yields. Every
    mode pays b prefills at the window's start and leaves b requests unfinished at its end."""
    if not traces:
        return 0, 0.0
    start, end = min(t.submitted for t in traces), max(t.submitted for t in traces)
    tokens = sum(c for t in traces for when, c in zip(t.times, t.counts) if when <= end)
    return tokens, end - start


def latency_stats(traces: list[Trace]) -> dict[str, float | None]:
    ttft = [(t.times[0] - t.submitted) * 1e3 for t in traces if t.times]
    gaps = [(b - a) * 1e3 for t in traces for a, b in zip(t.times, t.times[1:])]
    tpot = [(t.times[-1] - t.times[0]) * 1e3 / (len(t.token_ids) - 1)
            for t in traces if len(t.token_ids) > 1 and t.times]
    return {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "itl_p50_ms": percentile(gaps, 50), "itl_p99_ms": percentile(gaps, 99),
            "tpot_ms": sum(tpot) / len(tpot) if tpot else None}


async def stream_one(submit: Callable[[], Any], rid: str) -> Trace:
    """Submit through `submit()` (a stream or an awaitable of one) and time its deltas."""
    trace = Trace(rid, time.perf_counter(), [], [], [])
    stream = submit()
    if inspect.isawaitable(stream):
        stream = await stream
    async for d in stream:
        if d.token_ids:
            trace.times.append(time.perf_counter())
            trace.counts.append(len(d.token_ids))
            trace.token_ids += list(d.token_ids)
        if d.finished:
            trace.spec = (d.spec_verify_ct, d.spec_accepted_tokens, d.spec_draft_tokens)
    return trace


# --- the engine runs ----------------------------------------------------------------------
@dataclass
class Request:
    rid: str
    ids: list[int]


async def closed_loop(requests: list[Request], batch: int,
                      run: Callable[[Request], Any]) -> list[Trace]:
    """`run(r)` (a coroutine giving a Trace) for every request, at most `batch` at a time."""
    gate = asyncio.Semaphore(batch)

    async def one(r: Request) -> Trace:
        async with gate:
            return await run(r)

    return list(await asyncio.gather(*(one(r) for r in requests)))


async def run_local_wave(core: Any, wave: list[Request], params: Any,
                         batch: int) -> list[Trace]:
    core.start()
    # a closed wave is a batch job: its last request tells the engine the batch drains after it
    traces = await closed_loop(wave, batch, lambda r: stream_one(
        lambda: core.add_request(EngineCall(r.rid, r.ids, params, last=r is wave[-1])), r.rid))
    await core.idle()  # the release-only plan frees the slots before another mode's wave
    return traces


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
                    spread=(max(rates) - min(rates)) / median if median else None,
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


# --- models -------------------------------------------------------------------------------
def parse_layers(spec: str, num_layers: int) -> list[int]:
    """'0-5,27-29' -> [0..5, 27..29]. 'auto' skips layers 4 .. 4 + n/7 (SmolLM2: 4-7, keeping
    26 of 30): measured teacher-forced agreement with the target, SmolLM2 on three prompts,
    was 0.72 for that, 0.33 skipping 4-11, 0.20 skipping 24-27, <= 0.07 skipping more; the
    first half of a tiny model otherwise."""
    if spec == "auto":
        if num_layers < 8:
            return list(range(max(1, num_layers // 2)))
        return [i for i in range(num_layers) if not 4 <= i < 4 + num_layers // 7]
    keep: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        keep += list(range(int(lo), int(hi or lo) + 1))
    if not keep or any(not 0 <= i < num_layers for i in keep):
        raise ValueError(f"--draft-layers {spec!r}: layers must be in 0..{num_layers - 1}")
    return sorted(set(keep))


def layer_skip_draft(target: Any, keep: list[int], num_slots: int, max_len: int) -> Any:
    """A draft runner over the target's own modules, keeping only layers `keep`: no extra
    weight memory, its own KV cache (the stand-in for a smaller sibling model)."""
    src = target.model
    cfg = dataclasses.replace(target.config, num_layers=len(keep))
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model.embed, model.norm, model.lm_head = src.embed, src.norm, src.lm_head
    model.rotary = src.rotary
    model.layers = torch.nn.ModuleList(src.layers[i] for i in keep)
    return ModelRunner(model, cfg, num_slots=num_slots, max_len=max_len, device=target.device,
                       dtype=target.dtype, backend=target.backend)


class LocalBench:
    """One target runner shared by an engine per mode, all wired by build_local_engine."""

    def __init__(self, config: Any, args: argparse.Namespace) -> None:
        self.config = config
        self.args = args
        self.clock = Clock()
        self.target = build_runner(config, "target")
        self.clock.wrap_forward(self.target, "verify_forward")
        self.tokenizer = self.target.tokenizer
        self.draft_layers = parse_layers(args.draft_layers, self.target.config.num_layers)
        self.draft_runner: Any = None
        self.cores: dict[str, Any] = {}

    def core(self, mode: str) -> Any:
        if mode not in self.cores:
            self.cores[mode] = self._build(mode)
        return self.cores[mode]

    def _build(self, mode: str) -> Any:
        cfg = mode_config(self.config, mode, self.args.k)
        proposer = None
        if mode == "model":  # the draft model is built here (layer skip)
            if self.draft_runner is None:
                self.draft_runner = layer_skip_draft(self.target, self.draft_layers,
                                                     cfg.num_slots, cfg.max_model_len)
                self.clock.wrap_forward(self.draft_runner, "draft_forward")
            proposer = DraftModelProposer(self.draft_runner)
        return build_local_engine(cfg, self.target, proposer, timed_stages(self.clock))

    def run_wave(self, mode: str, wave: list[Request], params: Any,
                 batch: int | None = None) -> Segment:
        """`wave` with at most `batch` (default: all) in flight."""
        core = self.core(mode)
        before = snapshot(core.stats)
        self.clock.times = StageTimes()
        t0, c0 = time.perf_counter(), time.process_time()
        traces = asyncio.run(run_local_wave(core, wave, params, batch or len(wave)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return Segment(traces, wall, cpu, stats_delta(before, snapshot(core.stats)),
                       self.clock.times)


def mode_config(config: Any, mode: str, k: int) -> Any:
    """The engine config of a mode: `k` is the adaptive modes' most drafts per step."""
    if mode == "none":
        return config.replace(draft="none", num_speculative_tokens=0)
    if mode == "model":  # the bench builds the draft itself; the name is a placeholder
        return config.replace(draft="model", draft_model="layer-skip", num_speculative_tokens=k,
                              speculation="adaptive")
    if mode == "adaptive":
        return config.replace(draft="ngram", num_speculative_tokens=k, speculation="adaptive")
    if mode in ("suffix", "suffix-fixed"):
        return config.replace(draft="suffix", num_speculative_tokens=SUFFIX_K,
                              speculation="adaptive" if mode == "suffix" else "fixed")
    return config.replace(draft="ngram", num_speculative_tokens=FIXED_K[mode],
                          speculation="fixed")


def warmup_requests(tokenizer: Any) -> list[Request]:
    """Two requests every mode serves untimed before the first cell: one that copies, one that
    does not. Made from text in no workload, so no index holds a timed request's answer."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = " ".join(f.read().split())[:800]
    asks = (f"Repeat the following text exactly, word for word:\n\n{text}",
            "Write a short story about a lighthouse keeper who finds a message in a bottle.")
    return [Request(f"warmup-{i}", encode_prompt(tokenizer, a)) for i, a in enumerate(asks)]


def reference_outputs(runner: Any, prompts: dict[str, list[int]], max_tokens: int,
                      eos: list[int]) -> dict[str, list[int]]:
    """Target-only greedy output of each prompt, one request at a time, one token per forward,
    stopping after an EOS id like the engine: the yardstick every greedy mode must equal. Kept
    apart from the engine loop on purpose (and from tests/support/reference_decode.py, which is
    test-only): two independent decoders that agree are the evidence."""
    out = {}
    for key, ids in prompts.items():
        slot = runner.allocate()
        try:
            logits = runner.forward([slot], [list(ids)], last_only=True)[0]
            toks = [int(logits[-1].argmax())]
            while len(toks) < max_tokens and toks[-1] not in eos:
                logits = runner.forward([slot], [[toks[-1]]])[0]
                toks.append(int(logits[-1].argmax()))
        finally:
            runner.free(slot)
        out[key] = toks
    return out


def process_tree_cpu_s() -> float:
    """CPU seconds of this process and all its descendants (a local Ray cluster's raylet, GCS and
    actor workers are the driver's descendants); processes gone meanwhile are not counted."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def run_ray(bench: LocalBench, config: Any, mode: str, workload: str, batches: list[int],
            requests_for: Callable[[str, int, int], list[Request]], params: Any, reps: int,
            cores: int) -> list[RunResult]:
    """The same runs through `start_engine` on a Ray cluster of its own with `cores` CPUs, each
    wave interleaved with the in-process engine's run of the same wave. CPU time is the whole
    process tree's (driver, raylet, GCS, actors)."""
    # lazy: Ray (and the engine actor) load only for the Ray row
    import ray

    from actors.engine import start_engine, stop_engine
    from actors.engine_client import EngineClient

    ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
    handle = start_engine(mode_config(config, mode, bench.args.k))
    client = EngineClient(handle)
    results = []

    async def go(tag: str, wave: list[Request], batch: int) -> list[Trace]:
        return await closed_loop(wave, batch, lambda r: stream_one(
            lambda: client.generate(EngineCall(f"{tag}-{r.rid}", r.ids, params,
                                               last=r is wave[-1])),
            r.rid))

    try:
        asyncio.run(go("warm", requests_for(workload, 1, 0)[:1], 1))  # first forwards, actor paths
        for batch in batches:
            ray_reps, local_reps = [], []
            for rep in range(reps):
                ray_segs, local_segs = [], []
                load = requests_for(workload, batch, rep)
                local_segs.append(bench.run_wave(mode, load, params, batch))
                before = snapshot(ray.get(handle.stats.remote()))
                t0, c0 = time.perf_counter(), process_tree_cpu_s()
                traces = asyncio.run(go(f"ray{batch}.{rep}", load, batch))
                wall, cpu = time.perf_counter() - t0, process_tree_cpu_s() - c0
                spec = stats_delta(before, snapshot(ray.get(handle.stats.remote())))
                ray_segs.append(Segment(traces, wall, cpu, spec))
                ray_reps.append(ray_segs)
                local_reps.append(local_segs)
            res = merge("ray", mode, workload, batch, ray_reps)
            local = merge("local", mode, workload, batch, local_reps)
            res.cores = cores
            res.breakdown_ms = {"step": res.wall_s * 1e3 / max(res.steps, 1)}
            res.ray_vs_local = {"local_tokens_per_s": local.tokens_per_s,
                                "local_tokens_per_cpu_s": local.tokens_per_cpu_s,
                                "local_step_ms": local.breakdown_ms["step"],
                                "ray_overhead_ms_per_step":
                                    res.breakdown_ms["step"] - local.breakdown_ms["step"]}
            results.append(res)
    finally:
        stop_engine(handle)
        ray.shutdown()
    return results


def hf_wave(hf: Any, mode: str, wave: list[Request], max_tokens: int, k: int, max_ngram: int,
            eos: list[int]) -> Segment:
    """HF `generate`, batch 1: plain (`hf`) or with prompt lookup (`hf-pld`: k drafts, matching
    n-grams up to `max_ngram` long, as our n-gram drafter)."""
    extra = ({"prompt_lookup_num_tokens": k, "max_matching_ngram_size": max_ngram}
             if mode == "hf-pld" else {})
    traces = []
    t0, c0 = time.perf_counter(), time.process_time()
    for r in wave:
        ids = torch.tensor([r.ids])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              do_sample=False, pad_token_id=eos[0], eos_token_id=eos, **extra)
        traces.append(Trace(r.rid, t0, [], [], out[0, len(r.ids):].tolist()))
    return Segment(traces, time.perf_counter() - t0, time.process_time() - c0)


def load_hf(model_path: str) -> Any:
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
            dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


# --- checks, report -----------------------------------------------------------------------
def prompt_key(rid: str) -> str:
    """The workload prompt a request ran (rids are `<prompt id>#<i>.<rep>`)."""
    return rid.split("#", 1)[0]


def reference_mismatches(results: list[RunResult],
                         reference: dict[str, dict[str, list[int]]]) -> list[str]:
    """Every greedy engine output that differs from the reference, described."""
    out = []
    for r in results:
        if r.engine == "hf":
            continue
        ref = reference.get(r.workload, {})
        for rid, got in r.outputs.items():
            want = ref.get(prompt_key(rid))
            if want is None or got == want:
                continue
            pos = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b),
                       min(len(want), len(got)))
            out.append(f"{r.workload} batch {r.batch} {r.engine}/{r.mode} {rid}: differs at "
                       f"token {pos}: {want[pos:pos + 5]} vs {got[pos:pos + 5]} "
                       f"(lengths {len(want)} vs {len(got)})")
    return out


def hf_agreement(results: list[RunResult],
                 reference: dict[str, dict[str, list[int]]]) -> dict[str, float]:
    """Share of HF requests whose greedy output equals the reference (numerics, not a gate)."""
    out = {}
    for r in results:
        if r.engine == "hf" and r.outputs:
            ref = reference.get(r.workload, {})
            same = sum(ref.get(prompt_key(rid)) == toks for rid, toks in r.outputs.items())
            out[f"{r.mode}/{r.workload}"] = same / len(r.outputs)
    return out


def interleaved_parts(load: list[Request], batch: int) -> list[list[Request]]:
    """A repetition's requests in the parts the modes take turns on. At batch 1 each request is
    its own turn: the requests run one after another anyway, and this VM's speed drifts within
    a wave (copy b1: adaptive and k8 made the same decisions and ran 0.88-1.36 apart per
    4-request repetition), so modes a request apart are better paired than modes a wave apart. A
    batch b > 1 closed loop cannot be cut without changing what it measures: one turn."""
    return [[r] for r in load] if batch == 1 else [load]


def paired(a: RunResult, b: RunResult, busy: bool = False) -> float:
    """Median over repetitions of a's rate over b's in the same repetition (adjacent in time);
    `busy`: the rates over the busy window."""
    xs, ys = ((a.rep_busy_tokens_per_s, b.rep_busy_tokens_per_s) if busy
              else (a.rep_tokens_per_s, b.rep_tokens_per_s))
    return percentile([x / y for x, y in zip(xs, ys)], 50) or 0.0


def pooled(a: RunResult, b: RunResult) -> float:
    """a's rate over b's with every repetition pooled: all output tokens over all wall time.
    A third view beside the medians and the paired ratio: a repetition that ran slow for
    everyone weighs as its time did (copy b32 at cab7f20: 0.971x k4 on medians, 55.24 s of
    wall time against 55.02 over the same three waves)."""
    return (a.output_tokens / a.wall_s) / (b.output_tokens / b.wall_s)


def targets(results: list[RunResult]) -> dict[str, Any]:
    """The issue's targets per cell (workload, batch), on median tok/s, paired and pooled
    ratios."""
    by = {(r.engine, r.mode, r.workload, r.batch): r for r in results}
    cells = sorted({(r.workload, r.batch) for r in results if r.engine == "local"})
    out: dict[str, Any] = {}
    for w, b in cells:
        ad, none = by.get(("local", "adaptive", w, b)), by.get(("local", "none", w, b))
        fixed = {m: by[("local", m, w, b)] for m in FIXED_K if ("local", m, w, b) in by}
        if ad is None:
            continue
        cell: dict[str, Any] = {}
        if none is not None:
            cell["adaptive_vs_none (>= 0.97)"] = ad.tokens_per_s / none.tokens_per_s
            cell["adaptive_vs_none_paired"] = paired(ad, none)
            cell["adaptive_vs_none_pooled"] = pooled(ad, none)
            if ad.busy_tokens_per_s and none.busy_tokens_per_s:
                cell["busy: adaptive_vs_none"] = ad.busy_tokens_per_s / none.busy_tokens_per_s
                cell["busy: adaptive_vs_none_paired"] = paired(ad, none, busy=True)
        if fixed:
            best = max(fixed.values(), key=lambda r: r.tokens_per_s)
            cell["best_fixed"] = best.mode
            cell["adaptive_vs_best_fixed (>= 0.97)"] = ad.tokens_per_s / best.tokens_per_s
            cell["adaptive_vs_best_fixed_paired"] = min(paired(ad, r) for r in fixed.values())
            cell["adaptive_vs_best_fixed_pooled"] = min(pooled(ad, r) for r in fixed.values())
            cell["beats_every_fixed"] = all(ad.tokens_per_s > r.tokens_per_s
                                            for r in fixed.values())
            busy_fixed = [r.busy_tokens_per_s for r in fixed.values()]
            if ad.busy_tokens_per_s and all(busy_fixed):
                cell["busy: adaptive_vs_best_fixed"] = ad.busy_tokens_per_s / max(busy_fixed)
                cell["busy: adaptive_vs_best_fixed_paired"] = min(
                    paired(ad, r, busy=True) for r in fixed.values())
        for m in ("suffix", "suffix-fixed"):
            sx = by.get(("local", m, w, b))
            if sx is not None and none is not None:
                cell[f"{m}_vs_none"] = sx.tokens_per_s / none.tokens_per_s
                cell[f"{m}_vs_none_paired"] = paired(sx, none)
            if sx is not None:
                cell[f"{m}_vs_adaptive_ngram"] = sx.tokens_per_s / ad.tokens_per_s
        out[f"{w}/b{b}"] = cell
    copy1 = out.get("copy/b1", {}).get("adaptive_vs_none (>= 0.97)")
    out["copy_b1_adaptive_vs_none (>= 1.8)"] = copy1
    out["mix_b8_beats_every_fixed"] = out.get("mix/b8", {}).get("beats_every_fixed")
    return out


def table(results: list[RunResult]) -> str:
    head = ("| engine | mode | workload | batch | tok/s median | spread | busy tok/s | tok/cpu-s | "
            "TTFT p50 ms | ITL p50 ms | tok/verify | acc. rate | step ms |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]

    def f(v: float | None, fmt: str = "{:.1f}") -> str:
        return "-" if v is None else fmt.format(v)

    for r in results:
        engine = r.engine if r.cores is None else f"{r.engine} ({r.cores} cores)"
        lines.append(
            f"| {engine} | {r.mode} | {r.workload} | {r.batch} | {r.tokens_per_s:.1f} | "
            f"{f(r.spread, '{:.0%}')} | {f(r.busy_tokens_per_s)} | {f(r.tokens_per_cpu_s or None)} | "
            f"{f(r.ttft_p50_ms, '{:.0f}')} | {f(r.itl_p50_ms, '{:.0f}')} | "
            f"{f(r.mean_accepted_len, '{:.2f}')} | {f(r.acceptance_rate, '{:.2f}')} | "
            f"{f(r.breakdown_ms.get('step'), '{:.0f}')} |")
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_engine.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "smollm2-cpu.yaml"))
    p.add_argument("--model", default=None, help="override the config's model (e.g. tiny:0)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (YAML value), e.g. --set weights=float")
    p.add_argument("--plan", nargs="+", default=["copy:1,8,32", "chat:1,8,32", "mix:1,8,32"],
                   help="workload:batch,batch... (a file in scripts/workloads or a .jsonl)")
    p.add_argument("--modes", nargs="+", default=["none", "adaptive", "k2", "k4", "k8"],
                   choices=MODES)
    p.add_argument("--reps", type=int, default=3, help="repetitions per cell (median, spread)")
    p.add_argument("--reps-b1", type=int, default=None,
                   help="repetitions of the batch-1 cells (default --reps): their segments are "
                        "short, so their medians need more of them (adaptive and k8 make the "
                        "same decisions there and still ran 0.87-0.99 apart per repetition)")
    p.add_argument("--requests", type=int, default=16,
                   help="requests per repetition at batch b > 1: max(b, this), b in flight")
    p.add_argument("--warm", nargs="*", default=[], metavar="WORKLOAD:N",
                   help="a workload's last N prompts, served untimed by every mode before its "
                        "cells (a running server's state: the adaptive pool, the suffix global "
                        "index); timed requests never reuse them")
    p.add_argument("--requests-b1", type=int, default=1,
                   help="requests per batch-1 wave set (batch b > 1 runs b requests)")
    p.add_argument("--max-tokens", type=int, default=64)
    # 16, not the fixed modes' largest 8: a cap costs the adaptive modes nothing where runs are
    # short (they pick k per step), and inside a copied run it halves the verifies. Copy at batch
    # 1 on an AVX2-only VM, where a 9-row forward costs 2.3x a 1-row one: 3.06 tokens a verify
    # and 1.77x target-only, against 2.73 and 1.69x with a cap of 8 (docs/benchmarks.md).
    p.add_argument("--k", type=int, default=16,
                   help="most drafts per step of the adaptive modes")
    p.add_argument("--hf-k", type=int, default=4, help="drafts per step of HF prompt lookup")
    p.add_argument("--draft-layers", default="auto",
                   help="target layers the stand-in draft keeps, e.g. 0-7,28-29")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampling (no check)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: see docs/benchmarks.md on oversubscription)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--ray-batches", type=int, nargs="*", default=[])
    p.add_argument("--ray-mode", default="adaptive", choices=MODES[:5])
    p.add_argument("--ray-workload", default="copy")
    p.add_argument("--ray-cores", type=int, default=2, help="CPUs given to the Ray cluster")
    p.add_argument("--out", default="bench-out",
                   help="folder for results.json and the plots (default bench-out, git-ignored: "
                        "results enter docs/bench only when copied there on purpose)")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if args.reps_b1 is None:
        args.reps_b1 = args.reps
    if args.reps < 1 or args.reps_b1 < 1:
        p.error("--reps and --reps-b1 must be at least 1")
    args.plan_batches = {}
    for item in args.plan:
        name, _, batches = item.rpartition(":")
        args.plan_batches[name] = [int(b) for b in batches.split(",")]
    args.batches = sorted({b for bs in args.plan_batches.values() for b in bs})
    args.workloads = list(args.plan_batches)
    args.warm = {w: int(n) for w, n in (item.split(":") for item in args.warm)}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides: dict[str, Any] = {"torch_threads": args.threads,
                                 "num_slots": max(args.batches + args.ray_batches),
                                 "max_model_len": 1024}
    if args.model:
        overrides["model"] = args.model
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    config = load_config(args.config, overrides)
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                            seed=0 if args.temperature > 0 else None)
    t_start = time.perf_counter()
    bench = LocalBench(config, args)
    tok = bench.tokenizer
    eos = eos_token_ids(tok)
    workloads = {w: [Request(p.id, encode_prompt(tok, p.text)) for p in load_workload(w)]
                 for w in args.workloads}
    for w, n in args.warm.items():
        if w not in workloads or not 0 <= n < len(workloads[w]):
            raise SystemExit(f"--warm {w}:{n}: not a planned workload with more than {n} prompts")

    def requests_for(w: str, batch: int, rep: int) -> list[Request]:
        n = args.requests_b1 if batch == 1 else max(batch, args.requests)
        reqs = workloads[w][: len(workloads[w]) - args.warm.get(w, 0)]  # never a warm-up prompt
        return [Request(f"{reqs[(i + rep * n) % len(reqs)].rid}#{i}.{rep}",
                        reqs[(i + rep * n) % len(reqs)].ids) for i in range(n)]

    warm = [Request("warm", workloads[args.workloads[0]][0].ids)]
    warm_params = dataclasses.replace(params, max_new_tokens=32)
    for mode in args.modes:  # first forwards, the step-cost model, drafted steps: all untimed
        bench.run_wave(mode, warmup_requests(tok), warm_params)
    model_path = None if is_tiny(config.model) else resolve_source(config.model)
    hf_model = None
    if not args.no_hf and model_path is not None and 1 in args.batches:
        hf_model = load_hf(model_path)
        for mode in ("hf", "hf-pld"):  # both paths warmed before anything is timed
            hf_wave(hf_model, mode, warm, 8, args.hf_k, config.ngram_max_n, eos)
    results: list[RunResult] = []
    for w in args.workloads:
        if args.warm.get(w):  # the workload's last prompts, served untimed by every mode
            served = workloads[w][-args.warm[w]:]
            for mode in args.modes:
                bench.run_wave(mode, [Request(f"warm-{r.rid}", r.ids) for r in served], params,
                               min(8, len(served)))
        for batch in args.batches:
            if batch not in args.plan_batches[w]:
                continue
            modes: list[tuple[str, str]] = [("local", m) for m in args.modes]
            if batch == 1 and hf_model is not None:
                modes += [("hf", "hf"), ("hf", "hf-pld")]
            reps: dict[tuple[str, str], list[list[Segment]]] = {m: [] for m in modes}
            for rep in range(args.reps_b1 if batch == 1 else args.reps):
                for m in modes:
                    reps[m].append([])
                parts = interleaved_parts(requests_for(w, batch, rep), batch)
                for turn, part in enumerate(parts, rep * len(parts)):
                    # Modes interleaved, the order rotated each turn: machine noise and cache
                    # warmth hit every mode alike.
                    order = modes[turn % len(modes):] + modes[:turn % len(modes)]
                    for engine, mode in order:
                        reps[(engine, mode)][-1].append(
                            bench.run_wave(mode, part, params, batch) if engine == "local"
                            else hf_wave(hf_model, mode, part, args.max_tokens, args.hf_k,
                                         config.ngram_max_n, eos))
            for (engine, mode), rs in reps.items():
                res = merge(engine, mode, w, batch, rs)
                results.append(res)
                print(f"[{time.perf_counter() - t_start:6.0f}s] {engine:5s} {mode:8s} {w:5s} "
                      f"b={batch:2d}: {res.tokens_per_s:7.1f} tok/s (reps "
                      f"{', '.join(f'{x:.1f}' for x in res.rep_tokens_per_s)}), tok/verify "
                      f"{res.mean_accepted_len or 0:.2f}", flush=True)
    if args.ray_batches and args.ray_workload in workloads:
        for res in run_ray(bench, config, args.ray_mode, args.ray_workload, args.ray_batches,
                           requests_for, params, args.reps, args.ray_cores):
            results.append(res)
            print(f"[{time.perf_counter() - t_start:6.0f}s] ray ({res.cores} cores) "
                  f"{args.ray_mode} {args.ray_workload} b={res.batch}: "
                  f"{res.tokens_per_s:.1f} tok/s, {res.tokens_per_cpu_s:.1f} tok/cpu-s", flush=True)
    reference: dict[str, dict[str, list[int]]] = {}
    mismatches: list[str] = []
    if args.temperature == 0:
        for w in args.workloads:
            reference[w] = reference_outputs(bench.target, {r.rid: r.ids for r in workloads[w]},
                                             args.max_tokens, eos)
        mismatches = reference_mismatches(results, reference)
    violations = [f"{r.engine}/{r.mode} {r.workload} b{r.batch} {v}"
                  for r in results for v in r.stats_violations]
    report = {
        "meta": meta(args, config, time.perf_counter() - t_start),
        "targets": targets(results),
        "hf_agreement": hf_agreement(results, reference),
        "greedy_equals_reference": not mismatches if args.temperature == 0 else None,
        "reference_mismatches": mismatches[:20],
        "num_reference_mismatches": len(mismatches),
        "stats_identity_holds": not violations,
        "stats_violations": violations[:20],
        "requests_checked": sum(r.requests for r in results if r.engine != "hf"),
        "runs": [dataclasses.asdict(r) for r in results],
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(table(results))
    print(json.dumps(report["targets"], indent=1))
    if not args.no_plots:
        try:
            from scripts.plots import write_plots
        except ImportError:  # run as a file: scripts/ itself is on sys.path
            from plots import write_plots  # type: ignore[no-redef]

        for path in write_plots(report, args.out):
            print(f"wrote {path}")
    failed = mismatches[:1] + violations[:1]
    for line in failed:
        print(f"check failed: {line}", file=sys.stderr)
    return 1 if failed else 0


def meta(args: argparse.Namespace, config: Any, elapsed: float) -> dict[str, Any]:
    return {"args": vars(args), "model": config.model, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(), "platform": platform.platform(), **tree_state(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "elapsed_s": elapsed}


if __name__ == "__main__":
    sys.exit(main())
