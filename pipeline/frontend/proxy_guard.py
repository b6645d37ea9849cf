"""The API key in front of Ray Serve's own proxy routes, `/-/routes` and `/-/healthz`, which the
proxy answers before any app (docs/reliability.md, "Serve's proxy routes"). Installed through
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, the one hook Serve 2.60 leaves; loopback clients may
probe `/-/healthz` without the key, and WebSocket upgrades get a JSON 4xx on every path."""

from __future__ import annotations

import os
from collections.abc import Callable

from starlette.middleware import Middleware

from pipeline.frontend.errors import APIError, error_response
from pipeline.frontend.guard import deny_websocket, key_refusal, websocket_refusal
from pipeline.frontend.settings import API_KEY_ENV

SYSTEM_ROUTES = ("/-/routes", "/-/healthz")
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


class SystemRoutesGuard:
    def __init__(self, app: Callable, api_key: str | None = None) -> None:
        self.app = app
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
        self.key = key.encode("utf-8") if key else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "websocket":
            await deny_websocket(self.refusal(scope) or websocket_refusal(), scope, receive, send,
                                 1)
            return
        refusal = self.refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await error_response(refusal, 1)(scope, receive, send)

    def refusal(self, scope: dict) -> APIError | None:
        path = scope.get("path", "")[len(scope.get("root_path", "")):]
        if self.key is None or path not in SYSTEM_ROUTES:
            return None
        client = scope.get("client") or ("", 0)
        if path == "/-/healthz" and client[0] in LOOPBACK:
            return None
        return key_refusal(scope.get("headers") or [], self.key)


def proxy_middlewares() -> list[Middleware]:
    return [Middleware(SystemRoutesGuard)]


CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


def proxy_guard_env(api_key: str) -> dict[str, str]:
    """Also without a key: the guard still refuses WebSocket upgrades, which the proxy would
    answer with a plain-text 500."""
    env = {CALLBACK_ENV: f"{__name__}:proxy_middlewares"}
    if api_key:
        env[API_KEY_ENV] = api_key
    return env
