"""One HTTP request's engine requests (one per choice), merged into one ordered event queue."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.errors import GrammarOutputError, RequestTimeoutError
from pipeline.frontend.background import fire_and_forget
from pipeline.frontend.errors import ClientGone
from pipeline.output.request_output import RequestOutput
from pipeline.params import SamplingParams
from pipeline.protocol.engine_call import EngineCall
from pipeline.tracing.otel import traceparent_of

log = logging.getLogger(__name__)


@dataclass
class InflightCount:
    value: int = 0


@dataclass
class ChoiceEvent:
    """A delta or the error that ended the choice (index -1: the client left)."""

    index: int
    output: RequestOutput | None = None
    error: BaseException | None = None


class EngineRun:
    """Counted in `inflight` from creation until `close`."""

    def __init__(self, engine: Any, span: Any, inflight: InflightCount,
                 group: str | None = None, tenant: str = "") -> None:
        self.engine = engine
        self.group = group  # its choices are admitted fairly as one
        self.tenant = tenant
        self.inflight = inflight
        inflight.value += 1
        self.closed = False
        self.span = span  # the HTTP server span, ended on close
        self.traceparent = traceparent_of(span)
        self.queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.rids: list[str] = []
        self.finished: set[int] = set()

    def start(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        index = len(self.rids)
        self.rids.append(rid)
        call = EngineCall(rid, prompt_ids, params, self.traceparent, group=self.group,
                          tenant=self.tenant)
        self.tasks.append(asyncio.get_running_loop().create_task(self._pump(index, call)))

    async def _pump(self, index: int, call: EngineCall) -> None:
        agen = None
        try:  # a failing call ends the choice with its error, never a hang
            agen = self.engine.generate(call)
            async for out in agen:
                if out.finished and out.finish_reason == "error":  # never shown as a choice
                    raise GrammarOutputError(out.error or "the output could not be completed")
                self.queue.put_nowait(ChoiceEvent(index, output=out))
                if out.finished:
                    break
        except Exception as e:  # noqa: BLE001 - the consumer maps it to a status
            self.queue.put_nowait(ChoiceEvent(index, error=e))
        finally:
            if agen is not None:
                await agen.aclose()

    def watch_disconnect(self, receive: Callable) -> None:
        async def watch() -> None:
            try:
                while (await receive())["type"] != "http.disconnect":
                    pass
            except Exception as e:  # noqa: BLE001 - a broken channel means the client is gone
                log.debug("receive failed: %s", e)
            self.queue.put_nowait(ChoiceEvent(-1, error=ClientGone()))

        self.tasks.append(asyncio.get_running_loop().create_task(watch()))

    async def next(self, deadline: float | None) -> tuple[int, RequestOutput]:
        """Raises engine errors, ClientGone and timeouts."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            event = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise RequestTimeoutError("request timed out") from None
        if event.error is not None:
            raise event.error
        assert event.output is not None
        if event.output.finished:
            self.finished.add(event.index)
        return event.index, event.output

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.rids)

    def close(self) -> None:
        """Synchronous, so it also runs in a cancelled handler."""
        if not self.closed:
            self.closed = True
            self.inflight.value -= 1
            if self.span is not None:
                self.span.end()
        for task in self.tasks:
            task.cancel()
        for i, rid in enumerate(self.rids):
            if i not in self.finished:
                fire_and_forget(self.engine.abort(rid))
