"""The OpenAI-compatible HTTP front end: `create_app(engine_client, tokenizer, settings)`.

No Ray here: the app talks to any object with the engine client API (`generate`, `abort`, `stats`,
`health`, `model_info`), so tests run it in-process with a fake engine, and `actors.serve_app`
mounts it in a Ray Serve deployment. Request flow:

    read body (size-limited) -> validate (pipeline.frontend.openai_api) -> tokenize -> one engine
    request per choice -> wait for every choice's first delta (so 429/408 are real statuses)
    -> JSON response or SSE stream, racing a client-disconnect watcher and the deadline.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry.trace import SpanKind
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.errors import EngineDeadError, EngineOverloadedError, RequestTimeoutError
from pipeline.frontend import openai_api as proto
from pipeline.frontend.background import fire_and_forget
from pipeline.frontend.metrics import CONTENT_TYPE, ServerMetrics
from pipeline.output.request_output import RequestOutput
from pipeline.params import SamplingParams
from pipeline.tracing.otel import context_from_traceparent, get_tracer, traceparent_of

log = logging.getLogger(__name__)
API_KEY_ENV = "SPECRELAY_API_KEY"
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
          "/openapi.json")


@dataclass
class ServerSettings:
    model_name: str | None = None  # served name; None: the engine's model_info()["name"]
    api_key: str | None = None  # None: read SPECRELAY_API_KEY; "" disables the check
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16 << 10  # all request headers together
    request_timeout_s: float | None = 600.0
    retry_after_s: int = 1
    health_timeout_s: float = 2.0
    stats_timeout_s: float = 2.0

    def resolved_api_key(self) -> str | None:
        key = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV)
        return key or None


class _ClientGone(Exception):
    """The HTTP client disconnected."""


# ----------------------------------------------------------------------------- tokenizer


class TokenizerAdapter:
    """The few tokenizer operations the server needs, over an HF or the tiny byte tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._strs: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.tok.encode(text, add_special_tokens=add_special_tokens))
        except TypeError:  # tokenizers without the keyword
            return list(self.tok.encode(text))

    def token_str(self, token_id: int) -> str:
        s = self._strs.get(token_id)
        if s is None:
            try:
                s = self.tok.decode([token_id], skip_special_tokens=False)
            except TypeError:
                s = self.tok.decode([token_id])
            self._strs[token_id] = s
        return s

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """The model's chat template applied to `messages` (a plain fallback without one)."""
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            text += "assistant:" if add_generation_prompt else ""
        # The template already holds the special tokens it wants.
        return self.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- one request's run


class _Run:
    """The engine requests of one HTTP request (one per choice), merged into one event queue.
    Counted in `inflight` (a one-element list) from creation until `close`."""

    def __init__(self, engine: Any, span: Any, inflight: list[int]) -> None:
        self.engine = engine
        self.inflight = inflight
        inflight[0] += 1
        self.closed = False
        self.span = span  # the HTTP server span, ended on close; parent of the engine's spans
        self.traceparent = traceparent_of(span)
        self.queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = (
            asyncio.Queue())
        self.tasks: list[asyncio.Task] = []
        self.rids: list[str] = []
        self.finished: set[int] = set()

    def start(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        index = len(self.rids)
        self.rids.append(rid)
        self.tasks.append(asyncio.get_running_loop().create_task(
            self._pump(index, rid, prompt_ids, params)))

    async def _pump(self, index: int, rid: str, ids: list[int], params: SamplingParams) -> None:
        agen = self.engine.generate(rid, ids, params, self.traceparent)
        try:
            async for out in agen:
                self.queue.put_nowait((index, out, None))
                if out.finished:
                    break
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which maps it to a status
            self.queue.put_nowait((index, None, e))
        finally:
            await agen.aclose()

    def watch_disconnect(self, receive: Callable) -> None:
        async def watch() -> None:
            try:
                while (await receive())["type"] != "http.disconnect":
                    pass
            except Exception as e:  # noqa: BLE001 - a broken channel means the client is gone
                log.debug("receive failed: %s", e)
            self.queue.put_nowait((-1, None, _ClientGone()))

        self.tasks.append(asyncio.get_running_loop().create_task(watch()))

    async def next(self, deadline: float | None) -> tuple[int, RequestOutput]:
        """The next delta of any choice; engine errors, _ClientGone and timeouts are raised."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            index, out, err = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise RequestTimeoutError("request timed out") from None
        if err is not None:
            raise err
        assert out is not None
        if out.finished:
            self.finished.add(index)
        return index, out

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.rids)

    def close(self) -> None:
        """Synchronous so it also runs in a cancelled handler: stop pumps, abort the unfinished."""
        if not self.closed:
            self.closed = True
            self.inflight[0] -= 1
            if self.span is not None:
                self.span.end()
        for task in self.tasks:
            task.cancel()
        for i, rid in enumerate(self.rids):
            if i not in self.finished:
                fire_and_forget(self.engine.abort(rid))


# ----------------------------------------------------------------------------- the app


class _Server:
    def __init__(self, engine: Any, tokenizer: Any, settings: ServerSettings) -> None:
        self.engine = engine
        self.tok = TokenizerAdapter(tokenizer)
        self.settings = settings
        self._info: dict[str, Any] | None = None
        self.metrics = ServerMetrics(settings.model_name or "")
        self.inflight = [0]  # HTTP generation requests not yet closed
        self.draining = False

    async def drain(self, timeout: float) -> int:
        """Refuse new generation requests (503) and fail /health; wait up to `timeout` seconds
        for those in flight to finish. Returns how many are still in flight."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.inflight[0] > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.inflight[0]

    async def info(self) -> dict[str, Any]:
        if self._info is None:
            info = dict(await self.engine.model_info())
            info["served_name"] = self.settings.model_name or info.get("name") or "specrelay"
            info["eos"] = frozenset(int(t) for t in info.get("eos_token_ids", []))
            self._info = info
            self.metrics.set_model(info["served_name"])
        return self._info

    def check_model(self, info: dict[str, Any], model: str | None) -> None:
        names = {info["served_name"], info.get("name"), info.get("source")}
        if model is not None and model not in names:
            raise proto.APIError(404, f"The model `{model}` does not exist.", param="model",
                                 code="model_not_found")

    # --------------------------------------------------------------- completions / chat

    async def completions(self, request: Request) -> Response:
        req = proto.parse_completion_request(await read_json(request, self.settings))
        info = await self.info()
        self.check_model(info, req.model)
        prompts = []
        for one in proto.completion_prompts(req):
            ids = self.tok.encode(one) if isinstance(one, str) else list(one)
            proto.check_prompt_ids(ids, int(info["vocab_size"]), "prompt")
            prompts.append(ids)
        return await self._generate(request, req, prompts, info, chat=False)

    async def chat(self, request: Request) -> Response:
        req = proto.parse_chat_request(await read_json(request, self.settings))
        info = await self.info()
        self.check_model(info, req.model)
        ids = self.tok.chat_prompt(proto.chat_messages_as_dicts(req), req.add_generation_prompt)
        return await self._generate(request, req, [ids], info, chat=True)

    async def _generate(self, request: Request, req: Any, prompts: list[list[int]],
                        info: dict[str, Any], chat: bool) -> Response:
        if self.draining:
            raise proto.APIError(503, "server is shutting down; retry on another replica",
                                 type="server_error", code="server_shutting_down")
        jobs = []  # (prompt index, ids, params) per choice, choice index = position
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                params = proto.to_sampling_params(req, len(ids), int(info["max_model_len"]),
                                                  choice_index=p * req.n + j)
                jobs.append((p, ids, params))
        rid = proto.new_id("chatcmpl" if chat else "cmpl")
        for ids in prompts:
            self.metrics.observe_prompt(len(ids))
        t0 = time.monotonic()
        deadline = None if not self.settings.request_timeout_s else (
            t0 + self.settings.request_timeout_s)
        span = get_tracer().start_span(
            f"{request.method} {request.url.path}", kind=SpanKind.SERVER,
            context=context_from_traceparent(request.headers.get("traceparent")),
            attributes={"http.request.method": request.method, "url.path": request.url.path})
        run = _Run(self.engine, span, self.inflight)
        for i, (_, ids, params) in enumerate(jobs):
            run.start(f"{rid}-{i}", ids, params)
        run.watch_disconnect(request.receive)
        view = _View(self, req, info, rid, chat, run, jobs, prompts, t0)
        if not req.stream:
            try:
                return JSONResponse(await view.collect(deadline))
            finally:
                run.close()  # also when cancelled (client gone under Serve): aborts the rest
        try:
            # Engine errors (429 ...) become statuses only before the headers: wait for output.
            first = await view.first_deltas(deadline)
        except BaseException:
            run.close()
            raise
        return _SSEResponse(view.stream(first, deadline), on_close=run.close)

    # --------------------------------------------------------------- simple routes

    async def models(self, request: Request) -> Response:
        info = await self.info()
        return JSONResponse({"object": "list", "data": [{
            "id": info["served_name"], "object": "model", "created": int(time.time()),
            "owned_by": "specrelay", "root": info.get("source") or info.get("name"),
            "max_model_len": info.get("max_model_len")}]})

    async def health(self) -> Response:
        if self.draining:
            return JSONResponse({"healthy": False, "reason": "draining"}, status_code=503)
        try:
            h = await asyncio.wait_for(self.engine.health(), self.settings.health_timeout_s)
        except asyncio.TimeoutError:
            h = {"healthy": False, "reason": "engine did not answer the health check in time"}
        except Exception as e:  # noqa: BLE001 - any failure to answer is unhealthy
            h = {"healthy": False, "reason": f"{type(e).__name__}: {e}"}
        return JSONResponse(h, status_code=200 if h.get("healthy") else 503)

    async def metrics_text(self, request: Request) -> Response:
        await self.info()
        try:
            stats = await asyncio.wait_for(self.engine.stats(), self.settings.stats_timeout_s)
            self.metrics.update_engine_stats(stats)
        except Exception as e:  # noqa: BLE001 - front-end metrics still useful
            log.warning("engine stats unavailable for /metrics: %s", e)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


class _View:
    """Turns one run's deltas into OpenAI JSON or SSE chunks, and records metrics."""

    def __init__(self, server: _Server, req: Any, info: dict[str, Any], rid: str, chat: bool,
                 run: _Run, jobs: list, prompts: list[list[int]], t0: float) -> None:
        self.s, self.req, self.info, self.rid = server, req, info, rid
        self.chat, self.run = chat, run
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.choices = [proto.ChoiceState(index=i) for i in range(len(jobs))]
        self.t0 = t0
        self.last: list[float | None] = [None] * len(jobs)
        self.model = info["served_name"]
        self.created = int(time.time())
        self.want_logprobs = jobs[0][2].logprobs is not None

    async def first_deltas(self, deadline: float | None) -> list[tuple[int, RequestOutput]]:
        """The first delta of any choice, plus whatever else is already queued.

        Overload errors come before a choice's first delta, at submission, so by the time one
        choice has output the others' immediate errors are queued too. Choices still waiting
        for a slot do not hold back the stream of those already running."""
        got = [await self.run.next(deadline)]
        while not self.run.queue.empty():
            got.append(await self.run.next(deadline))
        return got

    def _record(self, index: int, out: RequestOutput) -> None:
        now = time.monotonic()
        last = self.last[index]
        self.s.metrics.observe_delta(len(out.token_ids), now - self.t0,
                                     None if last is None else now - last)
        if out.token_ids:
            self.last[index] = now
        self.choices[index].add(out)
        if out.finished:
            self.s.metrics.observe_finish(out.finish_reason, now - self.t0,
                                          out.spec_accepted_tokens)

    def stop_reason(self, c: proto.ChoiceState) -> Any:
        return proto.stop_reason(c.matched_stop, c.finish_reason, self.info["eos"],
                                 self.req.stop_token_ids or [])

    def _logprobs(self, token_ids: list[int], lps: list[float] | None,
                  top: list | None, offset: int) -> dict | None:
        if not self.want_logprobs:
            return None
        lps, top = lps or [], top or []
        if self.chat:
            return proto.chat_logprobs(token_ids, lps, top, self.s.tok.token_str)
        return proto.completion_logprobs(token_ids, lps, top, self.s.tok.token_str, offset)

    async def collect(self, deadline: float | None) -> dict[str, Any]:
        while not self.run.done:
            self._record(*await self.run.next(deadline))
        build = proto.chat_response if self.chat else proto.completion_response
        return build(self.rid, self.model, self.choices, self.prompt_tokens,
                     lambda c: self._logprobs(c.token_ids, c.logprobs, c.top_logprobs, 0),
                     self.stop_reason)

    async def stream(self, first: list, deadline: float | None) -> AsyncIterator[str]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        if self.chat:
            for c in self.choices:
                yield self._chunk(proto.chat_chunk(self.rid, self.model, self.created, c.index,
                                                   {"role": "assistant", "content": ""}),
                                  include_usage)
        pending = list(first)
        try:
            while True:
                while pending:
                    index, out = pending.pop(0)
                    chunk = self._delta_chunk(index, out)
                    if chunk is not None:
                        yield self._chunk(chunk, include_usage)
                if self.run.done:
                    break
                pending.append(await self.run.next(deadline))
        except _ClientGone:
            return
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, then end
            yield proto.sse(error_for(e, self.s.settings).body())
            yield proto.SSE_DONE
            return
        if include_usage:
            yield proto.sse(proto.usage_chunk(
                self.rid, self.model, self.created,
                "chat.completion.chunk" if self.chat else "text_completion",
                self.prompt_tokens, sum(len(c.token_ids) for c in self.choices)))
        yield proto.SSE_DONE

    def _delta_chunk(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        c = self.choices[index]
        offset = len(c.text)
        self._record(index, out)
        if not out.text and not out.token_ids and not out.finished:
            return None
        if not out.text and not out.finished and not self.want_logprobs:
            return None  # tokens whose text is held back: nothing to show yet
        lp = self._logprobs(out.token_ids, out.logprobs, out.top_logprobs, offset)
        fin = {"finish_reason": c.finish_reason, "stop_reason": self.stop_reason(c),
               "spec_stats": c.spec_stats()} if out.finished else {}
        if self.chat:
            delta = {"content": out.text} if out.text or not out.finished else {}
            return proto.chat_chunk(self.rid, self.model, self.created, index, delta, lp, **fin)
        return proto.completion_chunk(self.rid, self.model, self.created, index, out.text, lp,
                                      **fin)

    @staticmethod
    def _chunk(chunk: dict[str, Any], include_usage: bool) -> str:
        if include_usage:
            chunk["usage"] = None
        return proto.sse(chunk)


class _SSEResponse(StreamingResponse):
    """An SSE response that notices a vanished client (send fails) and always runs `on_close`.

    Disconnects seen by `receive` are handled by the run's watcher, which ends the stream (so,
    unlike StreamingResponse, this one never reads `receive` itself)."""

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
            pass  # the client went away mid-send
        finally:
            self.on_close()
            try:
                await self.body_iter.aclose()  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001 - cleanup only; the run is already closed
                log.debug("closing the SSE body: %s", e)


async def read_json(request: Request, settings: ServerSettings) -> dict[str, Any]:
    """The body as a JSON object, refusing (413) to buffer more than max_body_bytes."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > settings.max_body_bytes:
            raise too_large(settings)
        chunks.append(chunk)
    return proto.parse_json_body(b"".join(chunks))


def too_large(settings: ServerSettings) -> proto.APIError:
    return proto.APIError(413, f"request body is larger than {settings.max_body_bytes} bytes",
                          code="request_too_large")


def error_for(exc: BaseException, settings: ServerSettings) -> proto.APIError:
    if isinstance(exc, proto.APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return proto.APIError(429, f"server is overloaded, retry later: {exc}",
                              type="rate_limit_error", code="engine_overloaded")
    if isinstance(exc, RequestTimeoutError):
        return proto.APIError(408, f"request timed out: {exc}", type="timeout_error",
                              code="request_timeout")
    if isinstance(exc, ValueError):  # the engine refused the request itself (prompt ids ...)
        return proto.bad_request(str(exc))
    if isinstance(exc, _ClientGone):
        return proto.APIError(499, "client closed the request", code="client_closed_request")
    if isinstance(exc, EngineDeadError):
        return proto.APIError(503, f"engine unavailable: {exc}", type="server_error",
                              code="engine_unavailable")
    return proto.APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def error_response(err: proto.APIError, settings: ServerSettings) -> JSONResponse:
    retry = err.status_code == 429 or err.code == "server_shutting_down"
    headers = {"Retry-After": str(settings.retry_after_s)} if retry else None
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


def create_app(engine_client: Any, tokenizer: Any, settings: ServerSettings | None = None,
               ) -> FastAPI:
    """The FastAPI app over `engine_client` (an EngineClient or a fake with the same API)."""
    settings = settings or ServerSettings()
    server = _Server(engine_client, tokenizer, settings)
    app = FastAPI(title="specrelay", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(_Guard, server=server, settings=settings)

    @app.exception_handler(proto.APIError)
    async def _api_error(request: Request, exc: proto.APIError) -> JSONResponse:
        return error_response(exc, settings)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(proto.APIError(exc.status_code, str(exc.detail), code=code),
                              settings)

    def guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        # Every failure becomes an OpenAI error body (never a bare 500 or FastAPI's 422 shape).
        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:  # noqa: BLE001
                return error_response(error_for(e, settings), settings)
        return route

    app.add_api_route("/v1/completions", guarded(server.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", guarded(server.chat), methods=["POST"])
    app.add_api_route("/v1/models", guarded(server.models), methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", guarded(server.metrics_text), methods=["GET"])

    async def openapi(request: Request) -> Response:
        return JSONResponse(proto.openapi_schema())

    app.add_api_route("/openapi.json", guarded(openapi), methods=["GET"])
    return app


class _Guard:
    """ASGI middleware in front of the routes: header/body size limits, API key, status metrics."""

    def __init__(self, app: Callable, server: _Server, settings: ServerSettings) -> None:
        self.app, self.server, self.settings = app, server, settings
        key = settings.resolved_api_key()
        self.key = key.encode("utf-8") if key else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"
        status_box: list[int] = []

        async def send_recording(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_box.append(message["status"])
            await send(message)

        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                await error_response(refusal, self.settings)(scope, receive, send_recording)
            else:
                await self.app(scope, receive, send_recording)
        finally:
            if status_box:
                self.server.metrics.observe_http(route, status_box[0])

    def _refusal(self, scope: dict, path: str) -> proto.APIError | None:
        headers = scope.get("headers") or []
        if sum(len(k) + len(v) + 4 for k, v in headers) > self.settings.max_header_bytes:
            return proto.APIError(431, "request headers are too large",
                                  code="request_header_fields_too_large")
        if self.key is not None and path != "/health":
            auth = next((v for k, v in headers if k.lower() == b"authorization"), b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                return proto.APIError(401, "invalid or missing API key (Authorization: Bearer)",
                                      code="invalid_api_key")
        length = next((v for k, v in headers if k.lower() == b"content-length"), None)
        if length is not None:
            try:
                too_big = int(length) > self.settings.max_body_bytes
            except ValueError:
                return proto.bad_request("invalid Content-Length header")
            if too_big:
                return too_large(self.settings)
        return None

