"""The Ray row: the same waves through `start_engine` on a Ray cluster of its own, each
interleaved with the in-process engine's run of the same wave."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pipeline.protocol.engine_call import EngineCall
from scripts.engine_bench.local import LocalBench, mode_config
from scripts.engine_bench.results import RunResult, Segment, merge, snapshot, stats_delta
from scripts.engine_bench.traces import Trace, closed_loop, stream_one
from scripts.engine_bench.workloads import Request
from scripts.harness import stopwatch, tree_cpu_s


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
                with stopwatch(tree_cpu_s) as took:
                    traces = asyncio.run(go(f"ray{batch}.{rep}", load, batch))
                spec = stats_delta(before, snapshot(ray.get(handle.stats.remote())))
                ray_segs.append(Segment(traces, took.wall_s, took.cpu_s, spec))
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
