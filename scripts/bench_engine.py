"""End-to-end engine benchmark: modes x workloads x batch sizes on one set of weights, with
Hugging Face `generate` (plain and prompt lookup) as the outside baseline, in one process/run.

    .venv/bin/python scripts/bench_engine.py [--max-tokens 64] [--batches 1 8 32] ...
    specrelay bench [same flags]

Modes: `none` (target only), `ngram` (prompt lookup) and `model` (a draft model). SmolLM2-135M
has no smaller sibling here, so the `model` draft is a STAND-IN: the target's own weights with
most layers skipped (`--draft-layers`), sharing the embedding, final norm and LM head.

"Batch b" means b requests in flight together: the workload's prompts run in waves of b (a wave
starts when the previous one has finished), so TTFT never includes queueing.

Per run it records output tokens/s, requests/s, TTFT and inter-token latency p50/p99, accepted
length and acceptance rate, and (in-process) the step time split into draft, verify, output
processing and the rest. Under Ray (`--ray-batches`) only the totals are known; the difference
to the in-process run of the same configuration is the Ray overhead.

Writes `<out>/results.json` and PNG plots; exits 1 (after writing them) when greedy outputs
differ between modes, printing the first difference.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `actors`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD_DIR = os.path.join(ROOT, "scripts", "workloads")
MODES = ("none", "ngram", "model")


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


def timed_stages(clock: Clock, proposer: Any, verifier: Any, output: Any) -> Any:
    from pipeline.draft.step import draft_step
    from pipeline.engine.local import LocalStages

    class TimedStages(LocalStages):
        async def run_step(self, plan: Any) -> Any:
            t0 = time.perf_counter()
            proposal = draft_step(self.proposer, plan)
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

    return TimedStages(proposer, verifier, output)


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
    tokens_per_s: float
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
    wave_tokens_per_s: list[float] = field(default_factory=list)  # spread across waves
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
    return trace


# --- the engine runs ----------------------------------------------------------------------
@dataclass
class Request:
    rid: str
    ids: list[int]


def waves(requests: list[Request], batch: int) -> list[list[Request]]:
    return [requests[i:i + batch] for i in range(0, len(requests), batch)]


async def run_local_wave(core: Any, wave: list[Request], params: Any) -> list[Trace]:
    core.start()
    traces = await asyncio.gather(*(stream_one(
        lambda r=r: core.add_request(r.rid, r.ids, params), r.rid) for r in wave))
    # Let the release-only plan free the slots before the next wave reuses the runner.
    for _ in range(1000):
        if not core.scheduler.has_work:
            break
        await asyncio.sleep(0)
    return list(traces)


@dataclass
class Segment:
    """One wave of one mode: what it produced and what it cost."""

    traces: list[Trace]
    wall: float
    cpu: float  # this process's CPU seconds (steadier than wall on a shared machine)
    spec: dict[str, Any] | None = None
    times: StageTimes | None = None


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    hist_b, hist_a = before["histogram"], after["histogram"]
    hist = [n - (hist_b[i] if i < len(hist_b) else 0) for i, n in enumerate(hist_a)]
    return {k: after[k] - before[k] for k in ("steps", "verifies", "accepted_tokens",
                                              "drafted_tokens")} | {"histogram": hist}


def snapshot(stats: Any) -> dict[str, Any]:
    if isinstance(stats, dict):
        return {k: stats[k] for k in ("steps", "verifies", "accepted_tokens", "drafted_tokens")} \
            | {"histogram": list(stats.get("acceptance_histogram", []))}
    return {"steps": stats.steps, "verifies": stats.verifies,
            "accepted_tokens": stats.accepted_tokens, "drafted_tokens": stats.drafted_tokens,
            "histogram": list(stats.histogram)}


def merge(engine: str, mode: str, workload: str, batch: int,
          segs: list[Segment]) -> RunResult:
    """One RunResult from a mode's waves (interleaved with the other modes' waves)."""
    traces = [t for s in segs for t in s.traces]
    wall, cpu = sum(s.wall for s in segs), sum(s.cpu for s in segs)
    tokens = sum(len(t.token_ids) for t in traces)
    res = RunResult(engine, mode, workload, batch, len(traces), tokens, wall, tokens / wall,
                    len(traces) / wall, cpu_s=cpu, tokens_per_cpu_s=tokens / max(cpu, 1e-9),
                    wave_tokens_per_s=[sum(len(t.token_ids) for t in s.traces) / s.wall
                                       for s in segs],
                    **latency_stats(traces), outputs={t.rid: t.token_ids for t in traces})
    specs = [s.spec for s in segs if s.spec is not None]
    if specs:
        spec = {k: sum(x[k] for x in specs) for k in ("steps", "verifies", "accepted_tokens",
                                                        "drafted_tokens")}
        width = max(len(x["histogram"]) for x in specs)
        spec["histogram"] = [sum(x["histogram"][i] for x in specs if i < len(x["histogram"]))
                             for i in range(width)]
        res.steps = spec["steps"]
        res.histogram = spec["histogram"]
        if spec["verifies"]:
            res.mean_accepted_len = spec["accepted_tokens"] / spec["verifies"] + 1
        if spec["drafted_tokens"]:
            res.acceptance_rate = spec["accepted_tokens"] / spec["drafted_tokens"]
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
    import torch

    from pipeline.models.llama import LlamaModel
    from pipeline.models.runner import ModelRunner

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
    """One target runner shared by an engine per mode (draft: none, ngram, model)."""

    def __init__(self, config: Any, args: argparse.Namespace) -> None:
        from pipeline.models.runners import build_runner

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
        from pipeline.draft.model import DraftModelProposer
        from pipeline.engine.core import EngineCore
        from pipeline.engine.local import make_output_processor
        from pipeline.tokenizer import eos_token_ids
        from pipeline.verify.verifier import Verifier

        k = {"none": 0, "ngram": self.args.ngram_k}.get(mode, self.args.k)
        # The draft model is built here (layer skip), so the config only names a placeholder.
        cfg = self.config.replace(draft=mode, num_speculative_tokens=k,
                                  draft_model="layer-skip" if mode == "model" else None)
        if mode == "model":
            if self.draft_runner is None:
                self.draft_runner = layer_skip_draft(self.target, self.draft_layers,
                                                     cfg.num_slots, cfg.max_model_len)
                self.clock.wrap_forward(self.draft_runner, "draft_forward")
            proposer: Any = DraftModelProposer(self.draft_runner)
        else:
            from pipeline.draft.step import build_proposer

            proposer = build_proposer(cfg)
        output = make_output_processor(self.tokenizer, eos_token_ids(self.tokenizer))
        stages = timed_stages(self.clock, proposer, Verifier(self.target), output)
        return EngineCore(cfg, stages, self.target.vocab_size)

    def run_wave(self, mode: str, wave: list[Request], params: Any) -> Segment:
        core = self.core(mode)
        before = snapshot(core.stats)
        self.clock.times = StageTimes()
        t0, c0 = time.perf_counter(), time.process_time()
        traces = asyncio.run(run_local_wave(core, wave, params))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return Segment(traces, wall, cpu, stats_delta(before, snapshot(core.stats)),
                       self.clock.times)


def run_ray(bench: LocalBench, config: Any, mode: str, workload: str, batches: list[int],
            requests_for: Callable[[str, int], list[Request]], params: Any,
            k: int) -> list[RunResult]:
    """The same runs through `start_engine` (one engine for all batch sizes), each wave
    interleaved with the in-process engine's run of the same wave for a fair ratio."""
    import ray

    from actors.engine import start_engine, stop_engine
    from actors.engine_client import EngineClient

    owns = not ray.is_initialized()
    if owns:
        ray.init(num_cpus=max(2, config.tensor_parallel_size + 1), include_dashboard=False,
                 log_to_driver=False)
    cfg = config.replace(draft=mode, num_speculative_tokens=k if mode != "none" else 0)
    handle = start_engine(cfg)
    client = EngineClient(handle)
    results = []

    async def go(tag: str, wave: list[Request]) -> list[Trace]:
        traces = await asyncio.gather(*(stream_one(
            lambda r=r: client.generate(f"{tag}-{r.rid}", r.ids, params), r.rid)
            for r in wave))
        return list(traces)

    try:
        asyncio.run(go("warm", requests_for(workload, 1)[:1]))  # first forwards, actor paths
        for batch in batches:
            ray_segs, local_segs = [], []
            for i, wave in enumerate(waves(requests_for(workload, batch), batch)):
                local_segs.append(bench.run_wave(mode, wave, params))
                before = snapshot(ray.get(handle.stats.remote()))
                t0 = time.perf_counter()
                traces = asyncio.run(go(f"ray{batch}.{i}", wave))
                wall = time.perf_counter() - t0
                spec = stats_delta(before, snapshot(ray.get(handle.stats.remote())))
                ray_segs.append(Segment(traces, wall, 0.0, spec))
            res = merge("ray", mode, workload, batch, ray_segs)
            local = merge("local", mode, workload, batch, local_segs)
            res.tokens_per_cpu_s = 0.0  # the work runs in the actors' processes
            res.breakdown_ms = {"step": res.wall_s * 1e3 / max(res.steps, 1)}
            res.ray_vs_local = {"local_tokens_per_s": local.tokens_per_s,
                                "local_step_ms": local.breakdown_ms["step"],
                                "ray_overhead_ms_per_step":
                                    res.breakdown_ms["step"] - local.breakdown_ms["step"]}
            results.append(res)
    finally:
        stop_engine(handle)
        if owns:
            ray.shutdown()
    return results


def hf_wave(hf: Any, mode: str, wave: list[Request], max_tokens: int, k: int,
            eos: list[int]) -> Segment:
    """HF `generate`, batch 1: plain (`hf`) or with prompt lookup (`hf-pld`)."""
    import torch

    extra = {"prompt_lookup_num_tokens": k} if mode == "hf-pld" else {}
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
    import torch
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
            dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


# --- checks, report -----------------------------------------------------------------------
def first_difference(results: list[RunResult]) -> str | None:
    """Greedy outputs of every engine run of one (workload, batch) must be identical."""
    groups: dict[tuple[str, int], list[RunResult]] = {}
    for r in results:
        if r.engine != "hf":
            groups.setdefault((r.workload, r.batch), []).append(r)
    for (workload, batch), runs in groups.items():
        ref = runs[0]
        for other in runs[1:]:
            for rid, want in ref.outputs.items():
                got = other.outputs.get(rid)
                if got == want:
                    continue
                got = got or []
                pos = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b),
                           min(len(want), len(got)))
                return (f"{workload} batch {batch} request {rid}: {ref.engine}/{ref.mode} and "
                        f"{other.engine}/{other.mode} differ at output token {pos}: "
                        f"{want[pos:pos + 5]} vs {got[pos:pos + 5]} "
                        f"(lengths {len(want)} vs {len(got)})")
    return None


def hf_agreement(results: list[RunResult]) -> dict[str, float]:
    """Share of requests where HF's greedy output equals ours (a numerics check, not a gate)."""
    out = {}
    for r in results:
        if r.mode != "hf":
            continue
        ours = next((o for o in results if o.engine == "local" and o.mode == "none"
                     and o.workload == r.workload and o.batch == 1), None)
        if ours is not None:
            same = sum(ours.outputs.get(rid) == toks for rid, toks in r.outputs.items())
            out[r.workload] = same / max(len(r.outputs), 1)
    return out


def targets(results: list[RunResult]) -> dict[str, Any]:
    """The issue's four targets as ratios, on wall time and on this process's CPU time."""

    def get(engine: str, mode: str, workload: str, batch: int) -> RunResult | None:
        return next((r for r in results if (r.engine, r.mode, r.workload, r.batch)
                     == (engine, mode, workload, batch)), None)

    def ratio(a: RunResult | None, b: RunResult | None) -> dict[str, float] | None:
        if a is None or b is None:
            return None
        return {"wall": a.tokens_per_s / b.tokens_per_s,
                "cpu": a.tokens_per_cpu_s / max(b.tokens_per_cpu_s, 1e-9)}

    workloads = list(dict.fromkeys(r.workload for r in results))
    return {
        "ngram_b1_copy_vs_none (>= 1.8)": ratio(get("local", "ngram", "copy", 1),
                                                get("local", "none", "copy", 1)),
        "none_b1_vs_hf (>= 1)": {w: ratio(get("local", "none", w, 1), get("hf", "hf", w, 1))
                                 for w in workloads},
        "b8_vs_b1 (>= 4)": {f"{m}/{w}": ratio(get("local", m, w, 8), get("local", m, w, 1))
                            for m in MODES for w in workloads if get("local", m, w, 8)},
        "outside_forward_b8 (<= 0.15)": {f"{r.mode}/{r.workload}": r.outside_forward_frac
                                         for r in results
                                         if r.engine == "local" and r.batch == 8},
    }


def table(results: list[RunResult]) -> str:
    head = ("| engine | mode | workload | batch | tok/s | tok/cpu-s | req/s | TTFT p50/p99 ms | "
            "ITL p50/p99 ms | acc. len | acc. rate | step ms | outside fwd |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]

    def f(v: float | None, fmt: str = "{:.1f}") -> str:
        return "-" if v is None else fmt.format(v)

    for r in results:
        lines.append(
            f"| {r.engine} | {r.mode} | {r.workload} | {r.batch} | {r.tokens_per_s:.1f} | "
            f"{f(r.tokens_per_cpu_s or None)} | "
            f"{r.requests_per_s:.2f} | {f(r.ttft_p50_ms, '{:.0f}')}/{f(r.ttft_p99_ms, '{:.0f}')}"
            f" | {f(r.itl_p50_ms, '{:.0f}')}/{f(r.itl_p99_ms, '{:.0f}')} | "
            f"{f(r.mean_accepted_len, '{:.2f}')} | {f(r.acceptance_rate, '{:.2f}')} | "
            f"{f(r.breakdown_ms.get('step'), '{:.0f}')} | "
            f"{f(r.outside_forward_frac, '{:.0%}')} |")
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specrelay bench", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "smollm2-cpu.yaml"))
    p.add_argument("--model", default=None, help="override the config's model (e.g. tiny:0)")
    p.add_argument("--plan", nargs="+", default=["copy:1,8", "chat:1,8", "mix:8,32"],
                   help="workload:batch,batch... (a file in scripts/workloads or a .jsonl)")
    p.add_argument("--model-max-batch", type=int, default=8,
                   help="largest batch the (slow, stand-in) model draft runs at")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--requests-b1", type=int, default=2,
                   help="requests per batch-1 run (batch b > 1 runs b requests)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="speculative tokens per step")
    p.add_argument("--ngram-k", type=int, default=None,
                   help="speculative tokens for n-gram drafting and HF prompt lookup (--k)")
    p.add_argument("--draft-layers", default="auto",
                   help="target layers the stand-in draft keeps, e.g. 0-7,28-29")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampling (no check)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: see docs/benchmarks.md on oversubscription)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--ray-batches", type=int, nargs="*", default=[1, 8])
    p.add_argument("--ray-mode", default="ngram", choices=MODES[:2])
    p.add_argument("--ray-workload", default="copy")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    args.plan_batches = {}
    for item in args.plan:
        name, _, batches = item.rpartition(":")
        args.plan_batches[name] = [int(b) for b in batches.split(",")]
    args.batches = sorted({b for bs in args.plan_batches.values() for b in bs})
    args.workloads = list(args.plan_batches)
    if args.ngram_k is None:
        args.ngram_k = args.k
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from pipeline.config import is_tiny, load_config, resolve_source
    from pipeline.params import SamplingParams
    from pipeline.tokenizer import eos_token_ids

    torch.set_num_threads(args.threads)
    overrides: dict[str, Any] = {"torch_threads": args.threads,
                                 "num_slots": max(args.batches + args.ray_batches),
                                 "max_model_len": 1024}
    if args.model:
        overrides["model"] = args.model
    config = load_config(args.config, overrides)
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                            seed=0 if args.temperature > 0 else None)
    t_start = time.perf_counter()
    bench = LocalBench(config, args)
    tok = bench.tokenizer
    workloads = {w: [Request(p.id, encode_prompt(tok, p.text)) for p in load_workload(w)]
                 for w in args.workloads}

    def requests_for(w: str, batch: int) -> list[Request]:
        n = args.requests_b1 if batch == 1 else batch
        reqs = workloads[w]
        return [Request(f"{reqs[i % len(reqs)].rid}#{i}", reqs[i % len(reqs)].ids)
                for i in range(n)]

    warm = [Request("warm", workloads[args.workloads[0]][0].ids)]
    warm_params = dataclasses.replace(params, max_new_tokens=4)
    for mode in args.modes:
        bench.run_wave(mode, warm, warm_params)
    model_path = None if is_tiny(config.model) else resolve_source(config.model)
    hf_model = None
    if not args.no_hf and model_path is not None and 1 in args.batches:
        hf_model = load_hf(model_path)
        hf_wave(hf_model, "hf", warm, 4, args.k, [0])
    eos = eos_token_ids(tok)
    results: list[RunResult] = []
    for w in args.workloads:
        for batch in args.batches:
            if batch not in args.plan_batches[w]:
                continue
            modes: list[tuple[str, str]] = [("local", m) for m in args.modes
                                            if m != "model" or batch <= args.model_max_batch]
            if batch == 1 and hf_model is not None:
                modes += [("hf", "hf"), ("hf", "hf-pld")]
            segs: dict[tuple[str, str], list[Segment]] = {m: [] for m in modes}
            # Waves interleaved across modes: machine noise hits every mode alike.
            for wave in waves(requests_for(w, batch), batch):
                for engine, mode in modes:
                    segs[(engine, mode)].append(
                        bench.run_wave(mode, wave, params) if engine == "local"
                        else hf_wave(hf_model, mode, wave, args.max_tokens, args.ngram_k, eos))
            for (engine, mode), ss in segs.items():
                res = merge(engine, mode, w, batch, ss)
                results.append(res)
                print(f"[{time.perf_counter() - t_start:6.0f}s] {engine:5s} {mode:6s} {w:5s} "
                      f"b={batch:2d}: {res.tokens_per_s:7.1f} tok/s "
                      f"({res.tokens_per_cpu_s:6.1f}/cpu-s), acc.len "
                      f"{res.mean_accepted_len or 0:.2f}, step "
                      f"{res.breakdown_ms.get('step', 0):.0f} ms, outside fwd "
                      f"{res.outside_forward_frac or 0:.0%}", flush=True)
    if args.ray_batches and args.ray_workload in workloads:
        for res in run_ray(bench, config, args.ray_mode, args.ray_workload, args.ray_batches,
                           requests_for, params, args.ngram_k):
            results.append(res)
            print(f"[{time.perf_counter() - t_start:6.0f}s] ray   {args.ray_mode:5s} "
                  f"{args.ray_workload:5s} b={res.batch:2d}: {res.tokens_per_s:7.1f} tok/s, "
                  f"step {res.breakdown_ms['step']:.0f} ms vs local "
                  f"{res.ray_vs_local['local_step_ms']:.0f} ms", flush=True)
    diff = first_difference(results) if args.temperature == 0 else None
    report = {
        "meta": meta(args, config, time.perf_counter() - t_start),
        "targets": targets(results),
        "hf_agreement": hf_agreement(results),
        "identical_greedy_outputs": diff is None if args.temperature == 0 else None,
        "first_difference": diff,
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
    if diff is not None:
        print(f"greedy outputs differ: {diff}", file=sys.stderr)
        return 1
    return 0


def meta(args: argparse.Namespace, config: Any, elapsed: float) -> dict[str, Any]:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"args": vars(args), "model": config.model, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(), "platform": platform.platform(), "commit": commit,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "elapsed_s": elapsed}


if __name__ == "__main__":
    sys.exit(main())
