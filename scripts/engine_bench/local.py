"""The in-process engines under test: one target runner shared by an engine per mode, each
wired by build_local_engine with timed stages."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from typing import Any

import torch

from pipeline.draft.model import DraftModelProposer
from pipeline.engine.local import build_local_engine
from pipeline.models.llama import LlamaModel
from pipeline.models.runner import ModelRunner
from pipeline.models.runners import build_runner
from pipeline.protocol.engine_call import EngineCall
from scripts.engine_bench.results import Segment, snapshot, stats_delta
from scripts.engine_bench.stages import Clock, StageTimes, timed_stages
from scripts.engine_bench.traces import Trace, closed_loop, stream_one
from scripts.engine_bench.workloads import Request
from scripts.harness import stopwatch

MODES = ("none", "adaptive", "k2", "k4", "k8", "model", "suffix", "suffix-fixed")
FIXED_K = {"k2": 2, "k4": 4, "k8": 8}
SUFFIX_K = 32  # suffix drafts are cut by their own score; this is only the ceiling


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


async def run_local_wave(core: Any, wave: list[Request], params: Any,
                         batch: int) -> list[Trace]:
    core.start()
    # a closed wave is a batch job: its last request tells the engine the batch drains after it
    traces = await closed_loop(wave, batch, lambda r: stream_one(
        lambda: core.add_request(EngineCall(r.rid, r.ids, params, last=r is wave[-1])), r.rid))
    await core.idle()  # the release-only plan frees the slots before another mode's wave
    return traces


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
        with stopwatch() as took:
            traces = asyncio.run(run_local_wave(core, wave, params, batch or len(wave)))
        return Segment(traces, took.wall_s, took.cpu_s,
                       stats_delta(before, snapshot(core.stats)), self.clock.times)

