"""Engine: an async Ray actor that runs pipeline.engine.core's step loop over actor stages.

`start_engine(config)` creates it; it creates its stage actors (a DraftWorker, one TargetVerifier
per TP rank in a placement group, an OutputActor). When a stage fails, in-flight requests end
with EngineDeadError, the engine reports unhealthy, and it rebuilds its stage actors in the
background; `health()` turns healthy again once the new ones are up.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from pipeline.config import EngineConfig
from pipeline.engine.core import EngineCore
from pipeline.engine.model_info import model_info
from pipeline.engine.stage_resources import (
    engine_needs,
    live_stage_groups,
    stage_group_name,
    stage_resources,
)
from pipeline.errors import EngineDeadError, EngineOverloadedError
from pipeline.gc_tuning import tune_gc
from pipeline.output.delta_codec import decode_deltas
from pipeline.output.request_output import RequestOutput
from pipeline.protocol import (
    EngineCall,
    NewRequest,
    StepOutcome,
    StepPlan,
    decode_outcome,
    decode_rank_report,
    encode_new_request,
    encode_plan,
)
from pipeline.tracing.otel import context_from_traceparent, flush_tracing, get_tracer, setup_tracing
from pipeline.verify.ranks import check_rank_reports

log = logging.getLogger(__name__)


@dataclass
class StageActors:
    draft: Any
    verifiers: list[Any]
    output: Any
    placement_group: Any
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def all(self) -> list[Any]:
        return [self.draft, *self.verifiers, self.output]

    async def flush_telemetry(self, timeout_s: float = 5.0) -> None:
        """Let the tracing stage (the output actor) export its spans before it is killed; one
        that is gone or wedged is given up on after `timeout_s`."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.output.flush_telemetry.remote(timeout_s), timeout_s + 1)

    def kill(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in self.all:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):  # already removed
            remove_placement_group(self.placement_group)


async def create_stage_actors(config: EngineConfig,
                              report: Callable[[str], None] = lambda _: None,
                              group_name: str = "") -> StageActors:
    """Start the draft, verifier ranks (one bundle each of a placement group named `group_name`)
    and output actors, placed as `config.placement` says. `report` hears what it is waiting for
    (a placement group or an actor waits until the cluster has the resources, e.g. until a lost
    node is back)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # lazy: the stage actors import torch; the engine actor and the Serve replica that import
    # this module need only their classes, here
    from actors.draft import DraftWorker
    from actors.output import OutputActor
    from actors.verifier import TargetVerifier

    need = stage_resources(config)
    pg = placement_group(need.verifier_bundles, strategy=need.verifier_strategy, name=group_name)
    report(f"waiting for the verifier placement group ({need.verifier_strategy} "
           f"{need.verifier_bundles})")
    await pg.ready()
    verifiers = [
        ray.remote(TargetVerifier).options(
            num_cpus=1, num_gpus=need.verifier_gpus, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank)).remote(config, rank)
        for rank in range(config.tensor_parallel_size)
    ]
    draft = ray.remote(DraftWorker).options(
        num_cpus=0, num_gpus=need.draft_gpus, max_restarts=0,
        resources=need.draft_resources).remote(config)
    output = ray.remote(OutputActor).options(
        num_cpus=0, max_restarts=0, resources=need.output_resources).remote(config)
    report(f"waiting for the stage actors (draft {need.draft_resources}, "
           f"output {need.output_resources}) to start and load")
    init = None
    if config.tensor_parallel_size > 1:
        init = await verifiers[0].rendezvous_address.remote()
    loaded = await asyncio.gather(*(v.load.remote(init) for v in verifiers))
    out_info = await output.info.remote()
    await draft.ping.remote()
    info = {**loaded[0], **out_info}
    return StageActors(draft, verifiers, output, pg, info)


class RayStages:
    """pipeline.engine.core.Stages over actor handles. Every message is pipeline.protocol's msgpack
    bytes; the proposal and the payload travel as object refs from actor to actor, and the engine
    only reads the small StepOutcome.

    Every stage call is submitted as the engine's own call, never as a child of the request
    being served (see `_call`)."""

    def __init__(self, actors: StageActors) -> None:
        self.actors = actors
        self._context = contextvars.copy_context()  # the engine's build, not a request's task

    def _call(self, method: Any, *args: Any) -> Any:
        """`method.remote(*args)` under the engine's context. Ray takes the calling task from
        a context variable and, when that task is cancelled (a client went away), cancels its
        children too. A child still queued behind an earlier call to the same ordered stage
        actor (a `process` whose payload is being resolved) is then dropped before it is sent,
        and the stage waits for the missing sequence number: 30 s, restarted by every later
        call (ray-project/ray#65785), so the engine stalls until the step timeout."""
        return self._context.run(method.remote, *args)

    async def add_request(self, req: NewRequest, traceparent: str | None) -> None:
        await self._call(self.actors.output.add_request, encode_new_request(req), traceparent)

    async def run_step(self, plan: StepPlan) -> StepOutcome:
        plan_ref = ray.put(encode_plan(plan))  # encoded once for the draft and every rank
        proposal = self._call(self.actors.draft.propose, plan_ref)
        calls = [self._call(v.verify.options(num_returns=2), plan_ref, proposal)
                 for v in self.actors.verifiers]
        # Await every rank: a dead rank surfaces as its own error, not as rank 0 hanging.
        results = await asyncio.gather(*(outcome for outcome, _ in calls))
        outcome = decode_outcome(results[0])
        # every rank holds rank 0's blocks, or the step fails before its tokens are output
        check_rank_reports(outcome, [decode_rank_report(r) for r in results[1:]])
        outcome.payload = calls[0][1]  # an ObjectRef to the VerifyStep bytes
        return outcome

    async def process(self, payload: Any) -> list[RequestOutput]:
        return decode_deltas(await self._call(self.actors.output.process, payload))

    async def abort(self, rid: str) -> RequestOutput | None:
        deltas = decode_deltas(await self._call(self.actors.output.abort, rid))
        return deltas[0] if deltas else None

    async def dropped_steps(self) -> int:
        return await self._call(self.actors.output.dropped_steps)

    async def ping(self) -> None:
        """Every stage actor answers (raises when one is gone)."""
        await asyncio.gather(*(self._call(a.ping) for a in self.actors.all))

    async def close(self) -> None:
        """Before the stage actors are killed (CompiledStages tears its graph down)."""


def make_stages(actors: StageActors, config: EngineConfig) -> RayStages:
    """The stages over `actors` in `config.step_transport`; call it on the step loop."""
    if config.step_transport == "compiled":
        from actors.compiled_stages import CompiledStages  # lazy: ray.dag is only needed here

        return CompiledStages(actors, config)
    return RayStages(actors)


class Engine:
    """The engine actor (API used by the HTTP front end through actors.engine_client)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.actors: StageActors | None = None
        self.core: EngineCore | None = None
        self.stages: RayStages | None = None
        self.restarts = 0
        self.builds = 0  # with the actor's id, names each build's placement group
        self.actor_id = ""  # set by start(), in the actor
        self.past_stalls = 0  # stall detections of the cores replaced by rebuilds
        self.tracer: Any = None
        self._rebuilding: asyncio.Task | None = None
        self.build_phase = ""  # what a (re)build waits for, shown in health() while rebuilding
        self._loop: asyncio.AbstractEventLoop | None = None  # the step loop's (default group)

    async def start(self) -> dict[str, Any]:
        setup_tracing("specrelay-engine", self.config.tracing)  # config, else OTEL_* environment
        self.tracer = get_tracer()
        self._loop = asyncio.get_running_loop()
        self.actor_id = ray.get_runtime_context().get_actor_id()
        await self._build()
        tune_gc(self.config.gc_gen0_threshold)
        return await self.model_info()

    async def _build(self) -> None:
        self.builds += 1
        group = stage_group_name(self.actor_id, self.builds)
        self.actors = await create_stage_actors(self.config, self._set_build_phase, group)
        self.build_phase = ""
        self.stages = make_stages(self.actors, self.config)  # compiles a graph: on this loop
        # A rebuild keeps the step timings: the stall bound stays adapted (docs/reliability.md)
        stall = self.core.stall.carry_over() if self.core is not None else None
        core = EngineCore(self.config, self.stages, self.actors.info["vocab_size"], self.tracer,
                          stall=stall)
        self.core = core
        core.start().add_done_callback(lambda _t: self._on_loop_end(core))

    def _set_build_phase(self, phase: str) -> None:
        self.build_phase = phase

    def _on_loop_end(self, core: EngineCore) -> None:
        # Also after core.fail() (a failed health ping or registration) cancelled the loop.
        if core is self.core and core.dead_reason is not None and self._rebuilding is None:
            self.build_phase = "stopping the failed stage actors"
            self._rebuilding = asyncio.get_running_loop().create_task(self._rebuild())

    async def _rebuild(self) -> None:
        """Replace every stage actor (KV caches are gone anyway) after a failure."""
        if self.core is not None:
            self.past_stalls += self.core.stats.stalls
        try:
            if self.actors is not None:
                await self.actors.flush_telemetry()  # the replaced output actor's spans
                if self.stages is not None:
                    await self.stages.close()  # a compiled graph goes before its actors
                self.actors.kill()
            await self._build()
            self.restarts += 1
        except Exception:  # stays unhealthy; the reason is in health()
            log.exception("engine rebuild failed")
        finally:
            self._rebuilding = None

    async def generate(self, call: EngineCall) -> AsyncIterator[RequestOutput]:
        """The request's deltas (EngineCore.add_request); a caller that stops reading early
        aborts it."""
        core = self._core()
        rid = call.rid
        # The engine's part of the request's trace (a sibling of the output actor's spec.request).
        span = self.tracer.start_span("spec.engine.request", context=context_from_traceparent(
            call.traceparent), attributes={"request.id": rid,
                                           "request.prompt_tokens": len(call.prompt_ids)})
        finished = False
        stream = None
        try:
            try:
                stream = await core.add_request(call)
            except (ValueError, EngineOverloadedError, EngineDeadError):
                raise  # refused (a refusal from the output actor arrives as a ValueError too)
            except Exception as e:  # noqa: BLE001 - the output actor is gone: fail and rebuild
                core.fail(EngineDeadError(f"output stage unavailable: {e}"))
                raise EngineDeadError(f"output stage unavailable: {e}") from None
            async for delta in stream:
                finished = delta.finished
                if delta.cached_tokens is not None:  # the first delta: what the cache served
                    span.set_attribute("request.cached_tokens", delta.cached_tokens)
                yield delta
        finally:
            span.end()
            if stream is not None and not finished:  # the caller went away: free its slots
                asyncio.ensure_future(core.abort(rid))

    async def abort(self, rid: str) -> None:
        if self.core is not None:
            await self.core.abort(rid)

    async def stats(self) -> dict[str, Any]:
        if self.core is None:
            return {"healthy": False}
        stats = await self.core.stats_dict()
        stats["healthy"] = (await self.health())["healthy"]
        stats["restarts"] = self.restarts
        stats["stalls"] = stats.get("stalls", 0) + self.past_stalls  # a counter across rebuilds
        return stats

    @ray.method(concurrency_group="control")
    async def health(self) -> dict[str, Any]:
        """From the engine's progress state, in its own concurrency group (own thread and event
        loop): never queued behind generate calls, so it answers while steps complete."""
        if self.core is None:
            return {"healthy": False, "reason": "engine not started"}
        if self._rebuilding is not None:
            return {"healthy": False, "reason": f"rebuilding after: {self.core.dead_reason}; "
                                                f"{self.build_phase}"}
        core = self.core
        state = core.health()
        if state["healthy"] and not core.scheduler.has_work:
            return await self._on_step_loop(self._ping_idle(core, state))
        return state

    async def _ping_idle(self, core: EngineCore, state: dict[str, Any]) -> dict[str, Any]:
        # Idle: nothing would notice a dead or wedged actor, so ask them; one that does not
        # answer within the stall floor fails the engine, which rebuilds its stages.
        try:
            await asyncio.wait_for(self.stages.ping(), self.config.step_timeout_floor_s)
        except Exception as e:  # noqa: BLE001 - any failure means a stage is gone
            reason = f"stage actor unavailable: {type(e).__name__}: {e}"
            if core is self.core:
                core.fail(EngineDeadError(reason))
            return {"healthy": False, "reason": reason}
        return state

    async def _on_step_loop(self, coro: Any) -> Any:
        """Run `coro` on the step loop's event loop (the core is not thread-safe)."""
        if self._loop is None or self._loop is asyncio.get_running_loop():
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def model_info(self) -> dict[str, Any]:
        return model_info(self.config, self.actors.info if self.actors is not None else {})

    async def stage_actors(self) -> dict[str, Any]:
        """Handles of the current stage actors (operations and failure tests)."""
        a = self.actors
        return {"draft": a.draft, "verifiers": list(a.verifiers), "output": a.output}

    async def shutdown(self) -> None:
        """Stop stepping, let every actor export its spans, kill the stage actors."""
        if self.core is not None:
            await self.core.stop()
        if self.actors is not None:
            await self.actors.flush_telemetry()
            if self.stages is not None:
                await self.stages.close()
            self.actors.kill()
        await asyncio.to_thread(flush_tracing)

    def _core(self) -> EngineCore:
        if self.core is None:
            raise EngineDeadError("engine is not started")
        if self._rebuilding is not None:
            raise EngineDeadError(f"engine is rebuilding after: {self.core.dead_reason}")
        return self.core


def start_engine(config: EngineConfig, name: str | None = None,
                 timeout_s: float | None = None) -> Any:
    """Create the Engine actor and its stage actors (inside a running Ray); returns the handle
    once the models are loaded. TimeoutError (saying what the engine needs and what the cluster
    has free) when that takes longer than `timeout_s`; the half-started engine is killed."""
    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1000, "max_restarts": 0,
                               "resources": stage_resources(config).engine_resources}
    if name is not None:
        options["name"] = name
    # health() has its own group: 1000 generate calls must not queue it (docs/reliability.md).
    engine = ray.remote(concurrency_groups={"control": 16})(Engine)
    handle = engine.options(**options).remote(config)
    try:
        ray.get(handle.start.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.kill(handle, no_restart=True)  # its stage actors go with it
        remove_stage_groups(handle)
        raise TimeoutError(
            f"the engine did not start within {timeout_s:.0f}s: it needs {engine_needs(config)}; "
            f"the cluster has {ray.available_resources()} available") from None
    return handle


def stop_engine(handle: Any) -> None:
    """Kill the stage actors and the engine actor."""
    try:
        ray.get(handle.shutdown.remote(), timeout=30)
    finally:
        ray.kill(handle, no_restart=True)
        remove_stage_groups(handle)


def remove_stage_groups(engine: Any) -> int:
    """Remove what is left of the placement groups the Engine actor `engine` made for its stages;
    returns how many. Ray frees a group made by an actor only once that actor and its job have
    both ended, and a Serve replica's job is the one that started Serve: an engine killed by a
    signal kept its verifier CPUs/GPUs reserved, and its replacement could wait for them."""
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    groups = live_stage_groups(ray.util.placement_group_table(), engine._actor_id.hex())
    for pg_id in groups:
        with contextlib.suppress(Exception):  # removed meanwhile
            remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
    return len(groups)
