"""Engine: an async Ray actor that runs pipeline.engine.core's step loop over actor stages.

`start_engine(config)` creates it; it creates its stage actors (a DraftWorker, one TargetVerifier
per TP rank in a placement group, an OutputActor). A dead draft actor costs nothing: steps go on
without drafts while a new one starts (actors.draft_stage). When another stage fails, in-flight
requests end with EngineDeadError, the engine reports unhealthy, and it rebuilds in the
background: the stages that answer a reset are kept, the others replaced
(pipeline.engine.stage_rebuild); `health()` turns healthy again once the new ones are up.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray

from actors.draft_stage import RayDraft
from actors.stage_actors import StageActors, create_stage_actors, replace_stages, reset_survivors
from actors.stage_groups import remove_stage_groups
from pipeline.config import EngineConfig
from pipeline.engine.core import EngineCore
from pipeline.engine.draft_failover import step_with_draft
from pipeline.engine.model_info import model_info
from pipeline.engine.relay import OutputChannel, request_sink
from pipeline.engine.stage_rebuild import Replace, until_built
from pipeline.engine.stage_resources import (
    engine_needs,
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


class RayStages:
    """pipeline.engine.core.Stages over actor handles. Every message is pipeline.protocol's msgpack
    bytes; the proposal and the payload travel as object refs from actor to actor, and the engine
    only reads the small StepOutcome.

    Every stage call is submitted as the engine's own call, never as a child of the request
    being served (see `_call`)."""

    sends_ahead = True  # calls to an actor run in the order sent

    def __init__(self, actors: StageActors, config: EngineConfig) -> None:
        self.actors = actors
        self.drafting = config.draft != "none"  # else no draft call: the ranks get no proposal
        self._context = contextvars.copy_context()  # the engine's build, not a request's task
        self.draft = RayDraft(config, actors, self._call)  # replaced when it dies

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
        # By value, inlined in each call (a ray.put object is fetched by every reader through
        # the raylet: +2-3 ms a step at batch 1); Ray puts one too large to inline itself.
        plan_bytes = encode_plan(plan)
        if not self.drafting:
            return await self._verify(plan_bytes, None)
        # a dead draft actor fails only its proposal: the ranks verify without one
        return await step_with_draft(plan, self.draft.failover,
                                     functools.partial(self.draft.propose, plan_bytes=plan_bytes),
                                     functools.partial(self._verify, plan_bytes), self.draft.died)

    async def _verify(self, plan: bytes, proposal: Any) -> StepOutcome:
        """Every rank verifies the plan (a failed proposal fails them before they run)."""
        calls = [self._call(v.verify.options(num_returns=2), plan, proposal)
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

    async def reset(self, timeout_s: float) -> Replace:
        """After a failure: every stage forgets its requests; which did not answer within
        `timeout_s` (a draft actor being replaced counts as not answering)."""
        return await reset_survivors(self.actors, self._call, self.draft.failover.live,
                                     timeout_s)

    async def ping(self) -> None:
        """Every verifier rank and the output actor answer (raises when one is gone); a dead
        draft actor is replaced instead."""
        await asyncio.gather(*(self._call(a.ping) for a in [*self.actors.verifiers,
                                                            self.actors.output]),
                             self.draft.ping())

    async def close(self) -> None:
        """Before the stage actors are killed (CompiledStages tears its graph down)."""


def make_stages(actors: StageActors, config: EngineConfig) -> RayStages:
    """The stages over `actors` in `config.step_transport`; call it on the step loop."""
    if config.step_transport == "compiled":
        from actors.compiled_stages import CompiledStages  # lazy: ray.dag is only needed here

        return CompiledStages(actors, config)
    return RayStages(actors, config)


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
        self._channels: dict[str, OutputChannel] = {}  # client relays (submit, outputs)
        self._ended: dict[str, asyncio.Future] = {}  # queued requests' ends (queue, wait)

    async def start(self) -> dict[str, Any]:
        setup_tracing("specrelay-engine", self.config.tracing)  # config, else OTEL_* environment
        self.tracer = get_tracer()
        self._loop = asyncio.get_running_loop()
        self.actor_id = ray.get_runtime_context().get_actor_id()
        await self._build()
        tune_gc(self.config.gc_gen0_threshold)
        return await self.model_info()

    async def _build(self, replace: Replace | None = None) -> None:
        """Start the stage actors (`replace`: only those, the others of the failed build are
        kept) and a new EngineCore over them."""
        self.builds += 1
        group = stage_group_name(self.actor_id, self.builds)
        if replace is not None and not replace.everything and self.actors is not None:
            self.actors = await replace_stages(self.config, self.actors, replace,
                                               self._set_build_phase, group)
        else:
            if self.actors is not None:  # nothing answered its reset
                self.actors.kill()
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
            self.build_phase = "resetting the stage actors"
            self._rebuilding = asyncio.get_running_loop().create_task(self._rebuild())

    async def _rebuild(self) -> None:
        """After a failure, replace the stage actors that do not answer a reset; the kept ones
        forget the failed requests (the new core's scheduler starts empty)."""
        if self.core is not None:
            self.past_stalls += self.core.stats.stalls
        try:
            await until_built(self._rebuild_once, self._set_build_phase)
            self.restarts += 1
        finally:
            self._rebuilding = None

    async def _rebuild_once(self) -> None:
        # Again after a failed attempt: the stages it kept answer the reset again, what it
        # started is gone (replace_stages cleans up), so it replaces them anew.
        if self.stages is not None:
            await self.stages.close()  # a compiled graph goes before resets and kills
        await self._build(await self._survivors())

    async def _survivors(self) -> Replace | None:
        """Reset every stage of the failed build; which to replace (None: no build yet)."""
        if self.actors is None or self.stages is None:
            return None
        self.build_phase = "resetting the stage actors"
        replace = await self.stages.reset(self.config.step_timeout_floor_s)
        log.warning("engine rebuild: replacing %s", replace.describe())
        self.build_phase = f"replacing: {replace.describe()}"
        return replace

    async def submit(self, call: EngineCall, channel: str,
                     ended: asyncio.Future | None = None) -> None:
        """Queue a request (EngineCore.add_request) whose deltas go out on `channel`'s stream
        (`outputs`); raises what add_request raises, and nothing is queued then. `ended` is set
        once its last delta or its error went out."""
        core = self._core()
        out = self._channels.setdefault(channel, OutputChannel())
        # The engine's part of the request's trace (a sibling of the output actor's spec.request).
        span = self.tracer.start_span("spec.engine.request", context=context_from_traceparent(
            call.traceparent), attributes={"request.id": call.rid,
                                           "request.prompt_tokens": len(call.prompt_ids)})
        sink = request_sink(out, span, ended)
        out.add(call.rid)
        try:
            await core.add_request(call, sink=sink)
        except BaseException as e:
            out.open.discard(call.rid)
            span.end()
            if isinstance(e, (ValueError, EngineOverloadedError, EngineDeadError)) or \
                    not isinstance(e, Exception):
                raise  # refused (a refusal from the output actor arrives as a ValueError too)
            core.fail(EngineDeadError(f"output stage unavailable: {e}"))  # gone: rebuild
            raise EngineDeadError(f"output stage unavailable: {e}") from None

    async def queue(self, call: EngineCall, channel: str) -> None:
        """`submit` from another process: returns once the request is queued (raises its
        refusal); `wait` then lasts until it has ended."""
        ended = asyncio.get_running_loop().create_future()
        await self.submit(call, channel, ended)
        if not ended.done():
            self._ended[call.rid] = ended
            ended.add_done_callback(lambda _: self._ended.pop(call.rid, None))

    async def wait(self, rid: str) -> None:
        """Returns once the queued request `rid` has ended (at once if it has): an engine
        replica's Serve call lasts as long as its request, so Serve counts it. Cancelled (its
        client left), it ends the request."""
        ended = self._ended.get(rid)
        if ended is None:
            return
        try:
            await asyncio.shield(ended)
        except asyncio.CancelledError:
            asyncio.ensure_future(self.abort(rid))
            raise

    async def outputs(self, channel: str) -> AsyncIterator[bytes]:
        """The deltas of every request submitted on `channel`, as they come (pipeline.engine.relay):
        one message per wake-up, whatever the batch. The reader going away aborts its requests."""
        out = self._channels.setdefault(channel, OutputChannel())
        try:
            async for message in out.batches():
                yield message
        finally:
            self._channels.pop(channel, None)
            if self.core is not None:
                for rid in list(out.open):
                    asyncio.ensure_future(self.core.abort(rid))

    async def abort(self, rid: str) -> None:
        if self.core is not None:
            await self.core.abort(rid)

    async def stats(self) -> dict[str, Any]:
        if self.core is None:
            return {"healthy": False}
        stats = await self.core.stats_dict()
        stats["healthy"] = (await self.health())["healthy"]
        stats["restarts"] = self.restarts
        if self.stages is not None:
            stats.update(self.stages.draft.stats())
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
        if self._rebuilding is not None:  # what it started is discarded as it is cancelled
            self._rebuilding.cancel()
            with contextlib.suppress(BaseException):
                await self._rebuilding
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
