"""One request's engine deltas -> an OpenAI JSON body or SSE stream, and its metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from pipeline.frontend import responses as resp
from pipeline.frontend.errors import ClientGone, error_for
from pipeline.frontend.metrics import ServerMetrics
from pipeline.frontend.run import EngineRun
from pipeline.output.request_output import RequestOutput
from pipeline.output.tool_calls import ToolDelta
from pipeline.output.tool_parsers import new_tool_stream

log = logging.getLogger(__name__)


@dataclass
class ResponseShape:
    rid: str
    model: str
    chat: bool
    n_choices: int
    prompt_tokens: int
    want_logprobs: bool
    include_usage: bool  # streams: a final usage chunk, and "usage": null on the others
    num_prompts: int = 1
    tool_names: list[str] | None = None  # parse tool calls of these functions (chat only)
    tool_parser: str = "hermes"
    one_tool_call: bool = False  # parallel_tool_calls: false keeps only the first call
    tool_calls_forced: bool = False  # by the grammar (required / named): arguments streamed


class ResponseWriter:
    def __init__(self, shape: ResponseShape, run: EngineRun, metrics: ServerMetrics,
                 token_str: Callable[[int], str], t0: float) -> None:
        self.shape, self.run, self.metrics, self.token_str = shape, run, metrics, token_str
        self.choices = [resp.ChoiceState(index=i) for i in range(shape.n_choices)]
        self.t0 = t0
        self.last: list[float | None] = [None] * shape.n_choices
        self.created = int(time.time())
        self.tool_streams = None if shape.tool_names is None else [
            new_tool_stream(shape.tool_parser, shape.tool_names, shape.tool_calls_forced)
            for _ in range(shape.n_choices)]

    async def first_deltas(self, deadline: float | None) -> list[tuple[int, RequestOutput]]:
        """What comes before the headers: every choice queued (the engine clients' empty first
        delta) or one refused, which raises while a status can still say so; then a first
        output of any choice, plus whatever else is queued. Choices waiting for a slot do not
        hold back the stream."""
        got: list[tuple[int, RequestOutput]] = []
        heard: set[int] = set()
        while len(heard) < self.shape.n_choices or not any(
                out.token_ids or out.finished for _, out in got):
            got.append(await self.run.next(deadline))
            heard.add(got[-1][0])
        while not self.run.queue.empty():
            got.append(await self.run.next(deadline))
        return got

    def _record(self, index: int, out: RequestOutput) -> None:
        now = time.monotonic()
        last = self.last[index]
        self.metrics.observe_delta(len(out.token_ids), now - self.t0,
                                   None if last is None else now - last)
        if out.token_ids:
            self.last[index] = now
        self.choices[index].add(out)
        if out.finished:
            self.metrics.observe_finish(out.finish_reason, now - self.t0,
                                        out.spec_accepted_tokens, out.spec_draft_tokens)

    def stop_reason(self, c: resp.ChoiceState) -> Any:
        return resp.stop_reason(c)

    def _logprobs(self, token_ids: list[int], lps: list[float] | None,
                  top: list | None, offset: int) -> dict | None:
        if not self.shape.want_logprobs:
            return None
        lps, top = lps or [], top or []
        if self.shape.chat:
            return resp.chat_logprobs(token_ids, lps, top, self.token_str)
        return resp.completion_logprobs(token_ids, lps, top, self.token_str, offset)

    async def collect(self, deadline: float | None) -> dict[str, Any]:
        while not self.run.done:
            self._record(*await self.run.next(deadline))
        for c in self.choices if self.tool_streams is not None else ():
            self._parse(c, c.text, True)
        build = resp.chat_response if self.shape.chat else resp.completion_response
        return build(self.shape.rid, self.shape.model, self.choices, self.shape.prompt_tokens,
                     lambda c: self._logprobs(c.token_ids, c.logprobs, c.top_logprobs, 0),
                     self.stop_reason, resp.cached_tokens(self.choices, self.shape.num_prompts))

    async def stream(self, first: list[tuple[int, RequestOutput]], deadline: float | None,
                     ) -> AsyncIterator[str]:
        if self.shape.chat:
            # With tool calls parsed, content stays null until there is some (as non-streamed).
            role = {"role": "assistant"} if self.tool_streams else {"role": "assistant",
                                                                     "content": ""}
            for c in self.choices:
                yield self._sse(resp.chat_chunk(self.shape.rid, self.shape.model, self.created,
                                                c.index, dict(role)))
        pending = list(first)
        try:
            while True:
                while pending:
                    chunk = self._delta_chunk(*pending.pop(0))
                    if chunk is not None:
                        yield self._sse(chunk)
                if self.run.done:
                    break
                pending.append(await self.run.next(deadline))
        except ClientGone:
            return
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
            yield resp.sse(error_for(e).body())
            yield resp.SSE_DONE
            return
        if self.shape.include_usage:
            yield resp.sse(self._usage_chunk())
        yield resp.SSE_DONE

    def _usage_chunk(self) -> dict[str, Any]:
        s = self.shape
        return resp.usage_chunk(s.rid, s.model, self.created,
                                "chat.completion.chunk" if s.chat else "text_completion",
                                s.prompt_tokens, sum(len(c.token_ids) for c in self.choices),
                                resp.cached_tokens(self.choices, s.num_prompts))

    def _delta_chunk(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        c, s = self.choices[index], self.shape
        offset = len(c.text)
        self._record(index, out)
        text, calls = out.text, []
        if self.tool_streams is not None:
            d = self._parse(c, out.text, out.finished)
            text = d.content
            calls = [{"index": k.index, **k.openai()} for k in d.calls] + [
                {"index": i, "function": {"arguments": a}} for i, a in d.args]
        if not text and not calls and not out.token_ids and not out.finished:
            return None
        if not text and not calls and not out.finished and not s.want_logprobs:
            return None  # tokens whose text is held back: nothing to show yet
        lp = self._logprobs(out.token_ids, out.logprobs, out.top_logprobs, offset)
        fin = {"finish_reason": c.finish_reason, "stop_reason": self.stop_reason(c),
               "spec_stats": c.spec_stats()} if out.finished else {}
        if s.chat:
            delta: dict[str, Any] = ({"content": text} if text or not (
                out.finished or self.tool_streams) else {})
            if calls:
                delta["tool_calls"] = calls
            return resp.chat_chunk(s.rid, s.model, self.created, index, delta, lp, **fin)
        return resp.completion_chunk(s.rid, s.model, self.created, index, out.text, lp, **fin)

    def _parse(self, c: resp.ChoiceState, text: str, finished: bool) -> ToolDelta:
        """A text delta through the choice's tool-call parser."""
        stream = self.tool_streams[c.index]  # type: ignore[index]
        d = stream.feed(text)
        if finished:
            d.add(stream.finish())
        if self.shape.one_tool_call:
            d.calls = [k for k in d.calls if k.index == 0]
            d.args = [a for a in d.args if a[0] == 0]
        c.parsed = True
        c.content += d.content
        c.tool_calls += d.calls  # (streamed: the calls' arguments as first announced)
        return d

    def _sse(self, chunk: dict[str, Any]) -> str:
        if self.shape.include_usage:
            chunk["usage"] = None
        return resp.sse(chunk)


class SSEResponse(StreamingResponse):
    """Always runs `on_close`. Unlike StreamingResponse it never reads `receive`: the run's
    watcher handles disconnects."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, status_code=200, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.body_iter, self.on_close = body, on_close

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for text in self.body_iter:
                await send({"type": "http.response.body", "body": text.encode("utf-8"),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client left mid-send
        finally:
            self.on_close()
            try:
                await self.body_iter.aclose()  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001 - cleanup only
                log.debug("closing the SSE body: %s", e)
