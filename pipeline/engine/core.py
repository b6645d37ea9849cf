"""The engine's step loop as plain asyncio code: receive -> schedule -> draft + verify -> output ->
handle finishes. The stages sit behind `Stages`, so the same loop drives in-process objects
(`LocalStages`, fast tests) and Ray actors (`actors.engine.RayStages`).

Overlap: with `overlap` on, step s+1 is launched before step s's output has been processed, so a
finish notice arrives one step late; the late step's tokens for a finished request are dropped by
the output processor (counted in its `dropped_steps`), and the slots are freed by the next plan.

Failure: any stage error or a stalled step (slower than the stall bound of pipeline.engine.stall:
a multiple of the recent p99 step time, between `step_timeout_floor_s` and `step_timeout_s`) ends
every in-flight request with EngineDeadError and marks the engine unhealthy; new requests are
refused with the same error. A lost draft stage is not a failure: the stages verify without
drafts (pipeline.engine.draft_failover) and mark the outcome `undrafted`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from pipeline.config import EngineConfig
from pipeline.engine.scheduler import EngineRequest, Scheduler
from pipeline.engine.spec.policy import SpecController
from pipeline.engine.stall import StallDetector, plan_tokens
from pipeline.engine.stats import EngineStats, scheduler_view
from pipeline.errors import EngineDeadError
from pipeline.output.request_output import RequestOutput
from pipeline.protocol import EngineCall, NewRequest, StepOutcome, StepPlan


class Stages(Protocol):
    """What the loop drives. `payload` may be the message bytes or a handle to them."""

    def add_request(self, req: NewRequest, traceparent: str | None) -> Awaitable[None]:
        """Register a request with the output stage when it is queued (so it is known before
        any step carries it); ValueError when the output stage refuses it."""

    def run_step(self, plan: StepPlan) -> Awaitable[StepOutcome]:
        """Draft and verify one step."""

    def process(self, payload: Any) -> Awaitable[list[RequestOutput]]:
        """Run one step message through the output processor."""

    def abort(self, rid: str) -> Awaitable[RequestOutput | None]:
        """Abort a request in the output processor; its abort delta (None if unknown)."""

    def dropped_steps(self) -> Awaitable[int]:
        """How many per-request step windows the output processor dropped."""


class RequestStream:
    """The deltas of one request, in order; ends after the finished delta or raises an error.
    With a `sink` (a relay's OutputChannel.put) every item goes there instead, and the stream
    is not iterated."""

    def __init__(self, rid: str,
                 sink: Callable[[str, RequestOutput | BaseException], None] | None = None
                 ) -> None:
        self.rid = rid
        self._sink = sink
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._sink is not None:
            self._sink(self.rid, item)
        else:
            self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


class EngineCore:
    def __init__(self, config: EngineConfig, stages: Stages, vocab_size: int,
                 tracer: Any = None, stall: StallDetector | None = None) -> None:
        """`stall`: a detector carried over from the engine's previous stages (a rebuild)."""
        self.config = config
        self.tracer = tracer  # an OpenTelemetry tracer: one `spec.engine_step` span per step
        self.stages = stages
        self.scheduler = Scheduler(config.num_seqs, config.max_waiting, config.max_model_len,
                                   config.num_speculative_tokens, vocab_size,
                                   reserved_slots=config.reserved_slots,
                                   reserved_waiting=config.waiting_reserve,
                                   spec=SpecController(config.spec_settings),
                                   num_blocks=config.kv_blocks, block_size=config.block_size,
                                   token_budget=config.max_num_batched_tokens)
        self.stats = EngineStats()
        self.stall = stall or StallDetector(config.step_timeout_floor_s,
                                            config.step_timeout_p99_multiple,
                                            config.step_timeout_s)
        self.stall_bound_s = config.step_timeout_s  # of the step in flight
        self.last_progress = time.time()
        self.dead_reason: str | None = None
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._dropped = 0
        self._in_step = False  # a step's stages are running (see `idle`)
        self._step_started: float | None = None  # monotonic start of the step in flight
        # prompt tokens served from the prefix cache, per request, until its first delta
        self._cached: dict[str, int] = {}
        # finished running requests whose release plan has not yet run: a late step (overlap)
        # may still carry their tokens, so their ids are not reusable until it has
        self._unreleased: dict[str, asyncio.Event] = {}

    # --- requests ---------------------------------------------------------------------------
    async def add_request(self, call: EngineCall,
                          sink: Callable[[str, RequestOutput | BaseException], None] | None = None
                          ) -> RequestStream:
        """Queue a request and return its stream. Raises EngineDeadError, EngineOverloadedError
        (queue full) or ValueError (bad prompt or parameters, id in use); nothing is queued then.
        (`sink`: see RequestStream.)
        An id whose previous request has finished is reusable once that request's slots are
        freed (the next step): until then this waits, since the step after a stop was planned
        with the stopped request, and its tokens would reach the new one under the same id."""
        rid = call.rid
        while rid in self._unreleased:
            if self._task is None or self._task.done():  # no loop to run the release plan
                raise ValueError(f"request id {rid!r} is still being released")
            await self._unreleased[rid].wait()
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine is unhealthy: {self.dead_reason}")
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        req = self.scheduler.prepare(call)
        stream = self._streams[rid] = RequestStream(rid, sink)  # reserves the id across the await
        registered = False
        try:
            await self.stages.add_request(NewRequest(rid, req.prompt_ids, req.params, req.tenant),
                                          call.traceparent)
            registered = True
            if self._streams.get(rid) is not stream:
                # Aborted while registering (a client gone that early): never queue it, and
                # let the output stage forget it too. The stream already holds the abort delta.
                await self.stages.abort(rid)
                return stream
            was_idle = not self.scheduler.has_work
            self.scheduler.enqueue(req, call.last)  # the queue may have filled during the await
        except BaseException:
            self._streams.pop(rid, None)
            if registered:
                await self.stages.abort(rid)
            raise
        if was_idle:
            self.last_progress = time.time()  # the step-timeout clock starts with the work
        self._wake.set()
        return stream

    async def abort(self, rid: str) -> None:
        """End a request with an abort delta; a running one's slots are freed by the next plan."""
        stream = self._streams.pop(rid, None)
        if stream is None:
            return
        req = self._retire(rid)
        delta = None
        if req is not None and self.dead_reason is None:
            delta = await self.stages.abort(rid)
        stream.put(delta or RequestOutput(rid, finished=True, finish_reason="abort",
                                          finish_kind="abort"))
        self._wake.set()

    async def idle(self) -> None:
        """Wait until nothing is queued, running or left to release and no step is in flight
        (or the loop stopped): a finished request's slots are freed by a later plan, and a
        runner shared with another engine is reusable only once that plan ran."""
        while (self.scheduler.has_work or self._in_step) and \
                self._task is not None and not self._task.done():
            await asyncio.sleep(0.001)

    # --- the loop ---------------------------------------------------------------------------
    def start(self) -> asyncio.Task:
        """Run the loop as a task of the running event loop (again, after a loop ended)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()  # an Event belongs to the loop that first waits on it
            self._unreleased = {rid: asyncio.Event() for rid in self._unreleased}
            self._task = loop.create_task(self.run())
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for released in self._unreleased.values():  # waiters see no loop and give up
            released.set()

    async def run(self) -> None:
        """Step until stopped or a stage fails (then every in-flight request gets the error)."""
        pending: asyncio.Future | None = None  # the previous step's output, when overlapping
        try:
            while True:
                plan = self.scheduler.schedule()
                if plan is None:
                    if pending is not None:
                        await self._deliver(pending)
                        pending = None
                        continue
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                pending = await self._step(plan, pending)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any stage failure ends the engine's requests
            self._fail(e)

    async def _step(self, plan: StepPlan, pending: asyncio.Future | None) -> asyncio.Future | None:
        self._in_step = True
        try:
            return await self._run_step(plan, pending)
        finally:
            self._in_step = False
            self._step_started = None

    async def _run_step(self, plan: StepPlan, pending: asyncio.Future | None
                        ) -> asyncio.Future | None:
        span = self._start_span(plan)
        tokens = plan_tokens(plan)
        self.stall_bound_s = self.stall.bound(tokens)
        started = self._step_started = time.monotonic()
        step = asyncio.ensure_future(self._timed(self.stages.run_step(plan), plan.step, "verify"))
        if pending is not None:  # step s-1's output is handled while step s drafts and verifies
            await self._deliver(pending)
        try:
            outcome = await step
        finally:
            if span is not None:
                span.end()
        # the stages freed this plan's released requests, and every step that carried them is
        # processed (the last one's output was delivered above): their ids are free again
        for rid in plan.release:
            released = self._unreleased.pop(rid, None)
            if released is not None:
                released.set()
        if not plan.rids:  # a release-only step: nothing to output
            return None
        self.stall.record(time.monotonic() - started, tokens)
        for new, cached in zip(plan.new, outcome.cached):
            if new.num_output == 0 and new.rid in self._streams:  # not a preempted one's rerun
                self._cached[new.rid] = cached
                self.stats.prefix_queries += len(new.prompt_ids)
                self.stats.prefix_hits += cached
        self.scheduler.apply(outcome)
        # the outcome's rows: the prefills whose last chunk ran, then every verify
        new = len(outcome.rids) - len(plan.decode)
        self.stats.record(outcome, new)
        # the adaptive k learns from the decodes only, and never from a step the draft stage
        # missed (its rows asked for drafts that could not come: no sign of what would be kept)
        if not outcome.undrafted:
            self.scheduler.spec.observe(
                outcome.rids[new:], outcome.drafted[new:], [len(t) for t in outcome.tokens[new:]],
                outcome.decode_s, outcome.expected[new:] if outcome.expected else None)
        self.last_progress = time.time()
        if not outcome.rids:  # only prefill chunks that did not end their prompts
            return None
        output = asyncio.ensure_future(
            self._timed(self.stages.process(outcome.payload), plan.step, "output"))
        if self.config.overlap:
            return output
        await self._deliver(output)
        return None

    def _start_span(self, plan: StepPlan) -> Any:
        """The step's engine span, with the controller's decision when sampled; its context rides
        in the plan and the message, so the output actor's `spec.verify_step` span joins the
        same trace."""
        if self.tracer is None or not plan.rids:
            return None
        # lazy: the core imports no opentelemetry unless a tracer was handed to it
        from pipeline.engine.spec.record import span_attributes
        from pipeline.tracing.otel import traceparent_of

        span = self.tracer.start_span("spec.engine_step", attributes={
            "spec.step": plan.step, "spec.batch_size": len(plan.rids),
            "spec.prefills": len(plan.new)})
        if span.is_recording():  # why each k (spec.control.*): sampled steps only
            span.set_attributes(span_attributes(self.scheduler.spec.decision(),
                                                [n.rid for n in plan.new]))
        plan.traceparent = traceparent_of(span)
        return span

    async def _timed(self, work: Awaitable, step: int, stage: str) -> Any:
        # asyncio.wait, not wait_for: wait_for can swallow a cancellation that races with
        # the inner task finishing (CPython gh-86296), which hangs loop shutdown.
        task = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.stall_bound_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            self.stats.stalls += 1
            raise EngineDeadError(f"step {step}: {stage} stalled (no answer within "
                                  f"{self.stall_bound_s:.1f}s)")
        return task.result()

    async def _deliver(self, output: asyncio.Future) -> None:
        for delta in await output:
            if delta.rid in self._cached and delta.cached_tokens is None:
                delta.cached_tokens = self._cached.pop(delta.rid)
            stream = self._streams.get(delta.rid)
            if stream is None:  # aborted meanwhile: the abort delta already ended it
                if delta.finished:
                    self._retire(delta.rid)  # idempotent; never leave a slot behind
                continue
            stream.put(delta)
            if delta.finished:
                del self._streams[delta.rid]
                self._retire(delta.rid)
        self.last_progress = time.time()

    def _retire(self, rid: str) -> EngineRequest | None:
        """`Scheduler.finish`; a running request's id stays reserved until its slots are freed
        (`add_request`)."""
        req = self.scheduler.finish(rid)
        self._cached.pop(rid, None)
        if self.scheduler.releasing(rid):
            self._unreleased.setdefault(rid, asyncio.Event())
        return req

    def fail(self, exc: BaseException) -> None:
        """A stage failed outside the loop (a health ping, registering a request): end every
        in-flight request with EngineDeadError, refuse new ones, and stop the loop."""
        if self.dead_reason is None:
            self._fail(exc)
        if self._task is not None:
            self._task.cancel()

    def _fail(self, exc: BaseException) -> None:
        reason = str(exc) or type(exc).__name__
        self.dead_reason = f"{type(exc).__name__}: {reason}"
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(self.dead_reason)
        for rid, stream in list(self._streams.items()):
            stream.put(error)
            self.scheduler.finish(rid)
        self._streams.clear()
        for released in self._unreleased.values():  # waiters find the engine dead
            released.set()
        self._unreleased.clear()

    # --- views ------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        if self.dead_reason is not None:
            return {"healthy": False, "reason": self.dead_reason}
        if self._task is not None and self._task.done():
            return {"healthy": False, "reason": "engine loop stopped"}
        # The step in flight against its own bound (what the loop's stall check uses), not the
        # time since the last step ended: between steps the loop hands out a step's deltas and
        # plans the next, which under a large fan-out can take longer than a step's bound.
        started = self._step_started
        if started is not None and time.monotonic() - started > self.stall_bound_s:
            return {"healthy": False, "reason": f"the step in flight has run "
                    f"{time.monotonic() - started:.1f}s, over its bound {self.stall_bound_s:.1f}s"}
        stalled = time.time() - self.last_progress
        if started is None and self.scheduler.has_work and stalled > self.config.step_timeout_s:
            return {"healthy": False,  # a loop that stopped stepping with work to do
                    "reason": f"no progress for {stalled:.1f}s with pending requests"}
        return {"healthy": True, "reason": ""}

    async def stats_dict(self) -> dict[str, Any]:
        if self.dead_reason is None:  # a dead stage cannot answer: keep the last count
            try:
                self._dropped = await self.stages.dropped_steps()
            except Exception:  # noqa: BLE001, S110 - a stage died unnoticed: health() notices
                pass
        return {**scheduler_view(self.scheduler), **self.stats.view(), "dropped_steps": self._dropped,
                "healthy": self.health()["healthy"], "last_progress": self.last_progress,
                "stall_bound_s": self.stall_bound_s}
