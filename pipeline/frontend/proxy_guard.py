"""The API key in front of Ray Serve's own proxy routes, `/-/routes` and `/-/healthz`.

Serve 2.60's HTTP proxy answers those two itself, before any application sees the request, so the
app's Guard cannot cover them. `http_options.middlewares` is refused in 2.60 ("has been
removed"); what is left is RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH: the proxy actor calls the
function it names and wraps its whole ASGI app in the Starlette middlewares returned. This one
runs in the proxy's process and reads the key from SPECRELAY_API_KEY there
(docs/reliability.md).

Rules: with a key set, `/-/routes` needs it; `/-/healthz` needs it too unless the client is on
loopback (in-pod probes such as KubeRay's `wget localhost:8000/-/healthz`). Every other plain HTTP
request is passed on (the app's Guard checks it). WebSocket upgrades are refused here on every
path with a JSON 4xx (401 without the key where the key is needed, else 400): nothing serves
them, and Serve's proxy answers one to its own routes with a plain-text 500.
"""

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
    """ASGI middleware for Serve's proxy: Bearer key on its system routes."""

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
    """For RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=pipeline.frontend.proxy_guard:proxy_middlewares
    (clusters started outside `specrelay serve`, e.g. KubeRay)."""
    return [Middleware(SystemRoutesGuard)]


CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


def proxy_guard_env(api_key: str) -> dict[str, str]:
    """The environment a Serve proxy needs to run SystemRoutesGuard with `api_key`. Installed
    without a key too: the guard then passes plain HTTP on and still refuses WebSocket upgrades
    (a JSON 4xx instead of the proxy's plain-text 500)."""
    env = {CALLBACK_ENV: f"{__name__}:proxy_middlewares"}
    if api_key:
        env[API_KEY_ENV] = api_key
    return env
