"""The OpenAI-compatible HTTP front end: `create_app(engine_client, tokenizer, settings)`, over any
object with the engine client's API (tests use a fake). A generation request: guard, read and
validate, tokenize, one engine request per choice, then wait for every choice's first delta (so
429/408 are real statuses) before the JSON response or SSE stream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.trace import SpanKind
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.frontend import requests as reqs
from pipeline.frontend.errors import (
    APIError,
    HealthReasons,
    client_text,
    error_for,
    error_response,
)
from pipeline.frontend.guard import ROUTES, Guard, too_large
from pipeline.frontend.metrics import CONTENT_TYPE, ServerMetrics
from pipeline.frontend.openapi import openapi_schema
from pipeline.frontend.responses import new_id
from pipeline.frontend.run import EngineRun, InflightCount
from pipeline.frontend.settings import API_KEY_ENV, ServerSettings
from pipeline.frontend.structured import request_grammar, wants_grammar
from pipeline.frontend.tenant import bearer_token, tenant_id
from pipeline.frontend.tokenizer import TokenizerAdapter
from pipeline.frontend.tools import (
    forces_tool_calls,
    parses_tool_calls,
    supports_tools,
    template_text,
    template_tools,
    tool_names,
)
from pipeline.frontend.writer import ResponseShape, ResponseWriter, SSEResponse
from pipeline.output.tool_parsers import MARKERS, check_parser_template
from pipeline.params import SamplingParams
from pipeline.tracing.otel import context_from_traceparent, get_tracer

log = logging.getLogger(__name__)

__all__ = ["API_KEY_ENV", "ROUTES", "ServerSettings", "create_app"]

AnyRequest = reqs.CompletionRequest | reqs.ChatCompletionRequest


@dataclass
class ChoiceJob:
    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class ModelInfo:
    served_name: str
    names: frozenset[str]  # what a request's `model` may say
    root: str | None
    vocab_size: int
    max_model_len: int

    @classmethod
    def from_engine(cls, info: dict[str, Any], served_name: str | None) -> ModelInfo:
        served = served_name or info.get("name") or "specrelay"
        names = {served, info.get("name"), info.get("source")}
        return cls(served_name=served, names=frozenset(n for n in names if n),
                   root=info.get("source") or info.get("name"),
                   vocab_size=int(info["vocab_size"]), max_model_len=int(info["max_model_len"]))


class Server:
    def __init__(self, engine: Any, tokenizer: Any, settings: ServerSettings) -> None:
        self.engine = engine
        self.tok = TokenizerAdapter(tokenizer)
        self.settings = settings
        self._info: ModelInfo | None = None
        self.metrics = ServerMetrics(settings.model_name or "")
        self.inflight = InflightCount()
        self.draining = False
        self.health_reasons = HealthReasons()
        self.tools_on = settings.tool_call_parser != "none"
        if self.tools_on and not supports_tools(tokenizer):
            log.warning("tool_call_parser is %s but the chat template has no tools: requests "
                        "with tools get a 400", settings.tool_call_parser)
        elif self.tools_on:
            check_parser_template(settings.tool_call_parser, template_text(tokenizer))

    async def drain(self, timeout: float) -> int:
        """Refuse new generation requests and fail /health; returns how many are still in flight
        after up to `timeout` seconds."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.inflight.value > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.inflight.value

    async def info(self) -> ModelInfo:
        if self._info is None:
            self._info = ModelInfo.from_engine(dict(await self.engine.model_info()),
                                               self.settings.model_name)
            self.metrics.set_model(self._info.served_name)
        return self._info

    @staticmethod
    def check_model(info: ModelInfo, model: str | None) -> None:
        if model is not None and model not in info.names:
            raise APIError(404, f"The model `{client_text(model)}` does not exist.", param="model",
                           code="model_not_found")

    async def completions(self, request: Request) -> Response:
        req = reqs.parse_completion_request(await read_json(request, self.settings))
        info = await self.info()
        self.check_model(info, req.model)
        prompts = []
        split = self.split_special(req)
        for one in reqs.completion_prompts(req):
            ids = (self.tok.encode(one, split_special_tokens=split) if isinstance(one, str)
                   else list(one))
            reqs.check_prompt_ids(ids, info.vocab_size, "prompt")
            prompts.append(ids)
        return await self._generate(request, req, prompts, info)

    async def chat(self, request: Request) -> Response:
        req = reqs.parse_chat_request(await read_json(request, self.settings), self.tools_on)
        info = await self.info()
        self.check_model(info, req.model)
        if req.tools and not supports_tools(self.tok.tok):
            raise APIError(400, "tools: this model's chat template does not support tools, so "
                           "they cannot be shown to the model", param="tools",
                           code="unsupported_parameter")
        parser = self.settings.tool_call_parser
        if parses_tool_calls(req) and set(MARKERS[parser]) & set(self.tok.special_texts()):
            req.skip_special_tokens = False  # as vLLM: the parser must see special markers
        ids = self.tok.chat_prompt(reqs.chat_messages_as_dicts(req), req.add_generation_prompt,
                                   split_special_tokens=self.split_special(req),
                                   tools=template_tools(req))
        return await self._generate(request, req, [ids], info)

    def split_special(self, req: AnyRequest) -> bool:
        if req.split_special_tokens is not None:
            return req.split_special_tokens
        return self.settings.split_special_tokens

    def _jobs(self, req: AnyRequest, prompts: list[list[int]], info: ModelInfo,
              grammar: Any = None) -> list[ChoiceJob]:
        """Choices of prompt p are p*n .. p*n+n-1 (OpenAI's order)."""
        cap = self.settings.max_choices_per_request
        if len(prompts) * req.n > cap:
            raise APIError(400, f"prompt, n: {len(prompts)} prompt(s) x n={req.n} is "
                           f"{len(prompts) * req.n} choices; at most {cap} per request",
                           param="n", code="too_many_choices")
        jobs = []
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                index = p * req.n + j
                params = reqs.to_sampling_params(req, len(ids), info.max_model_len,
                                                 choice_index=index, grammar=grammar)
                jobs.append(ChoiceJob(index, p, ids, params))
        return jobs

    async def _generate(self, request: Request, req: AnyRequest, prompts: list[list[int]],
                        info: ModelInfo) -> Response:
        if self.draining:
            raise APIError(503, "server is shutting down; retry on another replica",
                           type="server_error", code="server_shutting_down")
        chat = isinstance(req, reqs.ChatCompletionRequest)
        grammar = None
        tool_parser = self.settings.tool_call_parser
        if wants_grammar(req, tool_parser):  # compiled (and refused with a 400) before a slot
            grammar = await asyncio.to_thread(request_grammar, req, self.tok.tok, tool_parser)
        jobs = self._jobs(req, prompts, info, grammar)  # all validated before any starts
        for ids in prompts:
            self.metrics.observe_prompt(len(ids))
        t0 = time.monotonic()
        timeout = self.settings.request_timeout_s
        deadline = t0 + timeout if timeout else None
        shape = ResponseShape(
            rid=new_id("chatcmpl" if chat else "cmpl"), model=info.served_name, chat=chat,
            n_choices=len(jobs), prompt_tokens=sum(len(p) for p in prompts),
            num_prompts=len(prompts),
            want_logprobs=jobs[0].params.logprobs is not None,
            tool_names=tool_names(req) if chat and parses_tool_calls(req) else None,
            tool_parser=self.settings.tool_call_parser,
            one_tool_call=chat and req.parallel_tool_calls is False,
            tool_calls_forced=chat and forces_tool_calls(req),
            include_usage=bool(req.stream and req.stream_options
                               and req.stream_options.include_usage))
        tenant = tenant_id(bearer_token(request.scope.get("headers") or []), req.user)
        run = self._start_run(request, shape.rid, jobs, tenant)
        writer = ResponseWriter(shape, run, self.metrics, self.tok.token_str, t0)
        if not req.stream:
            try:
                return JSONResponse(await writer.collect(deadline))
            finally:
                run.close()  # also when cancelled (client gone under Serve): aborts the rest
        try:
            # An engine error (429 ...) is a status only before the headers are sent.
            first = await writer.first_deltas(deadline)
        except BaseException:
            run.close()
            raise
        return SSEResponse(writer.stream(first, deadline), on_close=run.close)

    def _start_run(self, request: Request, rid: str, jobs: list[ChoiceJob],
                   tenant: str = "") -> EngineRun:
        span = get_tracer().start_span(
            f"{request.method} {request.url.path}", kind=SpanKind.SERVER,
            context=context_from_traceparent(request.headers.get("traceparent")),
            attributes={"http.request.method": request.method, "url.path": request.url.path})
        run = EngineRun(self.engine, span, self.inflight, group=rid, tenant=tenant)
        for job in jobs:
            run.start(f"{rid}-{job.index}", job.prompt_ids, job.params)
        run.watch_disconnect(request.receive)
        return run

    async def models(self, request: Request) -> Response:
        info = await self.info()
        return JSONResponse({"object": "list", "data": [{
            "id": info.served_name, "object": "model", "created": int(time.time()),
            "owned_by": "specrelay", "root": info.root, "max_model_len": info.max_model_len}]})

    async def health(self) -> Response:
        if self.draining:
            return JSONResponse({"healthy": False, "reason": "draining"}, status_code=503)
        try:
            h = await asyncio.wait_for(self.engine.health(), self.settings.health_timeout_s)
        except asyncio.TimeoutError:
            h = {"healthy": False, "reason": "engine did not answer the health check in time"}
        except Exception as e:  # noqa: BLE001 - any failure to answer is unhealthy
            h = {"healthy": False, "reason": f"{type(e).__name__}: {e}"}
        healthy = bool(h.get("healthy"))
        body = {"healthy": healthy, "reason": self.health_reasons.short(str(h.get("reason", "")))}
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def metrics_text(self, request: Request) -> Response:
        await self.info()
        try:
            stats = await asyncio.wait_for(self.engine.stats(), self.settings.stats_timeout_s)
            self.metrics.update_engine_stats(stats)
        except Exception as e:  # noqa: BLE001 - front-end metrics still useful
            log.warning("engine stats unavailable for /metrics: %s", e)
            self.metrics.engine_unreachable()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


async def read_json(request: Request, settings: ServerSettings) -> dict[str, Any]:
    """413 rather than buffer more than max_body_bytes."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > settings.max_body_bytes:
            raise too_large(settings)
        chunks.append(chunk)
    return reqs.parse_json_body(b"".join(chunks))


def create_app(engine_client: Any, tokenizer: Any, settings: ServerSettings | None = None,
               ) -> FastAPI:
    settings = settings or ServerSettings()
    server = Server(engine_client, tokenizer, settings)
    app = FastAPI(title="specrelay", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(Guard, metrics=server.metrics, settings=settings)
    retry_after_s = settings.retry_after_s

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, retry_after_s)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(APIError(exc.status_code, str(exc.detail), code=code),
                              retry_after_s)

    def guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        # An OpenAI error body, never a bare 500 or FastAPI's 422 shape.
        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:  # noqa: BLE001
                return error_response(error_for(e), retry_after_s)
        return route

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_schema())

    app.add_api_route("/v1/completions", guarded(server.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", guarded(server.chat), methods=["POST"])
    app.add_api_route("/v1/models", guarded(server.models), methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", guarded(server.metrics_text), methods=["GET"])
    app.add_api_route("/openapi.json", guarded(openapi), methods=["GET"])
    return app
