"""ASGI middleware in front of every route: size limits, the API key, the HTTP status metric."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from pipeline.frontend.errors import APIError, bad_request, error_response
from pipeline.frontend.metrics import ServerMetrics
from pipeline.frontend.settings import ServerSettings

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
          "/openapi.json")
UNAUTHENTICATED = ("/health",)  # probes (Kubernetes, load balancers) carry no key


def too_large(settings: ServerSettings) -> APIError:
    return APIError(413, f"request body is larger than {settings.max_body_bytes} bytes",
                    code="request_too_large")


class Guard:
    def __init__(self, app: Callable, metrics: ServerMetrics, settings: ServerSettings) -> None:
        self.app, self.metrics, self.settings = app, metrics, settings
        key = settings.resolved_api_key()
        self.key = key.encode("utf-8") if key else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "websocket":  # a JSON 4xx, never a 500
            headers = scope.get("headers") or []
            refusal = (key_refusal(headers, self.key) if self.key is not None
                       and scope.get("path", "") not in UNAUTHENTICATED else None)
            await deny_websocket(refusal or websocket_refusal(), scope, receive, send,
                                 self.settings.retry_after_s)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"
        statuses: list[int] = []

        async def send_recording(message: dict) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            await send(message)

        try:
            refusal = self.refusal(scope.get("headers") or [], path)
            if refusal is not None:
                response = error_response(refusal, self.settings.retry_after_s)
                await response(scope, receive, send_recording)
            else:
                await self.app(scope, receive, send_recording)
        finally:
            if statuses:
                self.metrics.observe_http(route, statuses[0])

    def refusal(self, headers: list[tuple[bytes, bytes]], path: str) -> APIError | None:
        if sum(len(k) + len(v) + 4 for k, v in headers) > self.settings.max_header_bytes:
            return APIError(431, "request headers are too large",
                            code="request_header_fields_too_large")
        if self.key is not None and path not in UNAUTHENTICATED:
            refusal = key_refusal(headers, self.key)
            if refusal is not None:
                return refusal
        length = next((v for k, v in headers if k.lower() == b"content-length"), None)
        if length is not None:
            try:
                too_big = int(length) > self.settings.max_body_bytes
            except ValueError:
                return bad_request("invalid Content-Length header")
            if too_big:
                return too_large(self.settings)
        return None


def websocket_refusal() -> APIError:
    return bad_request("WebSocket upgrades are not served here; use HTTP requests",
                       code="websocket_not_supported")


async def deny_websocket(err: APIError, scope: dict, receive: Callable, send: Callable,
                         retry_after_s: int) -> None:
    """`err` as an HTTP response where the server offers the WebSocket Denial Response
    extension, else a policy-violation close."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await error_response(err, retry_after_s)(scope, receive, send)
    else:
        await send({"type": "websocket.close", "code": 1008})


def key_refusal(headers: list[tuple[bytes, bytes]], key: bytes) -> APIError | None:
    auths = [v for k, v in headers if k.lower() == b"authorization"]
    if len(auths) > 1:
        # Proxies disagree on which copy counts: 400, not a 401 inviting new credentials.
        return bad_request("more than one Authorization header",
                           code="duplicate_authorization_header")
    auth = auths[0] if auths else b""
    given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
    if not hmac.compare_digest(given, key):
        return APIError(401, "invalid or missing API key (Authorization: Bearer)",
                        code="invalid_api_key")
    return None
