"""The engine's step loop in plain asyncio: receive -> schedule -> draft + verify -> output ->
finishes, driving in-process stages or Ray actors through `Stages`. With `overlap`, step s+1 runs
while step s's output is processed: a finish is seen a step late, its late tokens are dropped by
the output processor and its slots freed by the next plan. With `async_scheduling`, step s+1 is
sent before step s returns where the scheduler can plan it (`plan_ahead`). A stage error or a stalled step
(pipeline.engine.stall) ends every request with EngineDeadError and marks the engine unhealthy;
a lost draft stage only means steps without drafts (pipeline.engine.draft_failover)."""

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
from pipeline.protocol import EngineCall, HiddenStates, NewRequest, StepOutcome, StepPlan


class Stages(Protocol):
    sends_ahead: bool  # async_scheduling "auto" turns on: a step sent ahead hides a hop

    def add_request(self, req: NewRequest, traceparent: str | None) -> Awaitable[None]:
        """Register with the output stage before any step carries it (ValueError: refused)."""

    def run_step(self, plan: StepPlan) -> Awaitable[StepOutcome]: ...

    def process(self, payload: Any) -> Awaitable[list[RequestOutput]]: ...

    def abort(self, rid: str) -> Awaitable[RequestOutput | None]: ...

    def dropped_steps(self) -> Awaitable[int]: ...


class RequestStream:
    """One request's deltas; with a `sink` (a relay's OutputChannel.put) they go there."""

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
        self.config = config
        self.tracer = tracer
        self.stages = stages
        self.scheduler = Scheduler(config.num_seqs, config.max_waiting, config.max_model_len,
                                   config.num_speculative_tokens, vocab_size,
                                   reserved_slots=config.reserved_slots,
                                   reserved_waiting=config.waiting_reserve,
                                   spec=SpecController(config.spec_settings),
                                   num_blocks=config.kv_blocks, block_size=config.block_size,
                                   token_budget=config.max_num_batched_tokens)
        self.stats = EngineStats()
        # a rebuild hands over its detector
        self.stall = stall or StallDetector(config.step_timeout_floor_s,
                                            config.step_timeout_p99_multiple,
                                            config.step_timeout_s)
        self.stall_bound_s = config.step_timeout_s
        self.last_progress = time.time()
        self.dead_reason: str | None = None
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._dropped = 0
        self._in_step = False
        # the last outcome's aux states, for the next plan's draft stage (draft: eagle3)
        self._hidden: HiddenStates | None = None
        self._step_started: float | None = None
        self._cached: dict[str, int] = {}  # prefix-cache hits, until the request's first delta
        # finished, slots not yet released: a late step may still carry their ids' tokens
        self._unreleased: dict[str, asyncio.Event] = {}
        wanted = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and getattr(stages, "sends_ahead", False))
        self.async_scheduling = wanted and config.draft == "none"  # the verifier fills in rows
        self._ahead: tuple[StepPlan, Any, asyncio.Future] | None = None  # plan, span, call

    async def add_request(self, call: EngineCall,
                          sink: Callable[[str, RequestOutput | BaseException], None] | None = None
                          ) -> RequestStream:
        """Queue a request (or raise EngineDeadError, EngineOverloadedError, ValueError); a
        finished request's id is reused only once its slots are released (this waits)."""
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
                await self.stages.abort(rid)  # aborted while registering: never queue it
                return stream
            was_idle = not self.scheduler.has_work
            self.scheduler.enqueue(req, call.last)  # the queue may have filled meanwhile
        except BaseException:
            self._streams.pop(rid, None)
            if registered:
                await self.stages.abort(rid)
            raise
        if was_idle:
            self.last_progress = time.time()
        self._wake.set()
        return stream

    async def abort(self, rid: str) -> None:
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
        """Until no work and no step is left: a runner shared with another engine is free."""
        while (self.scheduler.has_work or self._in_step) and \
                self._task is not None and not self._task.done():
            await asyncio.sleep(0.001)

    def start(self) -> asyncio.Task:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()  # an Event belongs to the loop that first waits
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
        for released in self._unreleased.values():
            released.set()

    async def run(self) -> None:
        pending: asyncio.Future | None = None
        try:
            while True:
                if self._ahead is not None:  # planned and sent while the last step ran
                    (plan, *sent), self._ahead = self._ahead, None
                else:
                    plan, sent = self.scheduler.schedule(), None
                    if plan is None:
                        if pending is not None:
                            await self._deliver(pending)
                            pending = None
                            continue
                        self._wake.clear()
                        await self._wake.wait()
                        continue
                pending = await self._step(plan, pending, sent)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any stage failure ends the engine's requests
            self._fail(e)
        finally:
            self._drop_ahead()

    def _drop_ahead(self) -> None:
        if self._ahead is None:
            return
        _plan, span, call = self._ahead
        self._ahead = None
        call.cancel()
        if call.done() and not call.cancelled():
            call.exception()  # retrieved: the step that failed first is the one reported
        if span is not None:
            span.end()

    def _send(self, plan: StepPlan) -> tuple[Any, asyncio.Future]:
        span = self._start_span(plan)
        plan.hidden, self._hidden = self._hidden, None
        return span, asyncio.ensure_future(self.stages.run_step(plan))

    async def _step(self, plan: StepPlan, pending: asyncio.Future | None,
                    sent: list | None) -> asyncio.Future | None:
        self._in_step = True
        try:
            return await self._run_step(plan, pending, sent)
        finally:
            self._in_step = False
            self._step_started = None

    async def _run_step(self, plan: StepPlan, pending: asyncio.Future | None,
                        sent: list | None) -> asyncio.Future | None:
        span, call = sent or self._send(plan)
        tokens = plan_tokens(plan)
        self.stall_bound_s = self.stall.bound(tokens)
        started = self._step_started = time.monotonic()  # a step sent ahead: timed from here
        step = asyncio.ensure_future(self._timed(call, plan.step, "verify"))
        if pending is not None:
            await self._deliver(pending)
        if self.async_scheduling and self._ahead is None:
            ahead = self.scheduler.plan_ahead(plan)
            if ahead is not None:
                self._ahead = (ahead, *self._send(ahead))
                self.stats.steps_ahead += 1
        try:
            outcome = await step
            if outcome.hidden is not None:
                nbytes = outcome.hidden.rows.numel() * outcome.hidden.rows.element_size()
                self.stats.hidden_state_bytes += nbytes
                if span is not None:
                    span.set_attribute("spec.hidden_state_bytes", nbytes)
        finally:
            if span is not None:
                span.end()
        self._hidden = outcome.hidden
        # every step that carried a released request is processed now: its id is free again
        for rid in plan.release:
            released = self._unreleased.pop(rid, None)
            if released is not None:
                released.set()
        if not plan.rids:
            return None
        self.stall.record(time.monotonic() - started, tokens)
        for new, cached in zip(plan.new, outcome.cached):
            if new.num_output == 0 and new.rid in self._streams:  # not a preempted one's rerun
                self._cached[new.rid] = cached
                self.stats.prefix_queries += len(new.prompt_ids)
                self.stats.prefix_hits += cached
        self.scheduler.apply(outcome)
        new = len(outcome.rids) - len(plan.decode)
        self.stats.record(outcome, new)
        # a step the draft stage missed says nothing of drafts; with none there is nothing to learn
        if not outcome.undrafted and self.config.draft != "none":
            self.scheduler.spec.observe(
                outcome.rids[new:], outcome.drafted[new:], [len(t) for t in outcome.tokens[new:]],
                outcome.decode_s, outcome.expected[new:] if outcome.expected else None)
        self.last_progress = time.time()
        if not outcome.rids:
            return None
        output = asyncio.ensure_future(
            self._timed(self.stages.process(outcome.payload), plan.step, "output"))
        if self.config.overlap:
            return output
        await self._deliver(output)
        return None

    def _start_span(self, plan: StepPlan) -> Any:
        """The step's span; its context rides in the plan, so the output stage's span joins."""
        if self.tracer is None or not plan.rids:
            return None
        from pipeline.engine.spec.record import span_attributes
        from pipeline.tracing.otel import traceparent_of

        span = self.tracer.start_span("spec.engine_step", attributes={
            "spec.step": plan.step, "spec.batch_size": len(plan.rids),
            "spec.prefills": len(plan.new)})
        if span.is_recording():
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
            if stream is None:
                if delta.finished:
                    self._retire(delta.rid)
                continue
            stream.put(delta)
            if delta.finished:
                del self._streams[delta.rid]
                self._retire(delta.rid)
        self.last_progress = time.time()

    def _retire(self, rid: str) -> EngineRequest | None:
        req = self.scheduler.finish(rid)
        self._cached.pop(rid, None)
        if self.scheduler.releasing(rid):
            self._unreleased.setdefault(rid, asyncio.Event())
        return req

    def fail(self, exc: BaseException) -> None:
        """A stage failed outside the loop: fail every request and stop."""
        if self.dead_reason is None:
            self._fail(exc)
        if self._task is not None:
            self._task.cancel()

    def _fail(self, exc: BaseException) -> None:
        reason = str(exc) or type(exc).__name__
        self.dead_reason = f"{type(exc).__name__}: {reason}"
        self._hidden = None
        self._drop_ahead()
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(self.dead_reason)
        for rid, stream in list(self._streams.items()):
            stream.put(error)
            self.scheduler.finish(rid)
        self._streams.clear()
        for released in self._unreleased.values():
            released.set()
        self._unreleased.clear()

    def health(self) -> dict[str, Any]:
        if self.dead_reason is not None:
            return {"healthy": False, "reason": self.dead_reason}
        if self._task is not None and self._task.done():
            return {"healthy": False, "reason": "engine loop stopped"}
        # the step in flight against its own bound: a large fan-out's deltas may take longer
        started = self._step_started
        if started is not None and time.monotonic() - started > self.stall_bound_s:
            return {"healthy": False, "reason": f"the step in flight has run "
                    f"{time.monotonic() - started:.1f}s, over its bound {self.stall_bound_s:.1f}s"}
        stalled = time.time() - self.last_progress
        if started is None and self.scheduler.has_work and stalled > self.config.step_timeout_s:
            return {"healthy": False,
                    "reason": f"no progress for {stalled:.1f}s with pending requests"}
        return {"healthy": True, "reason": ""}

    async def stats_dict(self) -> dict[str, Any]:
        if self.dead_reason is None:
            try:
                self._dropped = await self.stages.dropped_steps()
            except Exception:  # noqa: BLE001, S110 - health() notices a dead stage
                pass
        return {**scheduler_view(self.scheduler), **self.stats.view(), "dropped_steps": self._dropped,
                "healthy": self.health()["healthy"], "last_progress": self.last_progress,
                "stall_bound_s": self.stall_bound_s}
