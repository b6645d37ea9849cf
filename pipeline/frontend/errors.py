"""OpenAI error bodies (`{"error": {"message", "type", "param", "code"}}`) and the mapping of
exceptions to HTTP statuses."""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pipeline.errors import (
    EngineDeadError,
    EngineOverloadedError,
    GrammarOutputError,
    RequestTimeoutError,
)

log = logging.getLogger(__name__)


@dataclass
class APIError(Exception):
    status_code: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        # Messages and params may echo client input: escaped so every body encodes.
        param = None if self.param is None else client_text(self.param, 200)
        return {"error": {"message": client_text(self.message, 2000), "type": self.type,
                          "param": param, "code": self.code}}


class ClientGone(Exception):
    """The HTTP client disconnected."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "function-after"}


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    # ("messages", 0, "role") -> "messages[0].role", without union tags such as "list[int]"
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part not in _UNION_TAGS and not re.search(r"[\[\]-]", part):
            out += ("." if out else "") + part
    return out or None


def from_validation_error(err: ValidationError) -> APIError:
    first = err.errors(include_url=False)[0]
    param = _loc_to_param(tuple(first.get("loc", ())))
    return bad_request(f"{param}: {first['msg']}" if param else first["msg"], param=param)


_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def from_params_error(err: ValueError, renames: dict[str, str] | None = None) -> APIError:
    msg = str(err)
    field_name = msg.split(":", 1)[0].strip() if ":" in msg else None
    names = {**_PARAM_NAMES, **(renames or {})}
    param = names.get(field_name, field_name) if field_name else None
    if param and field_name and field_name != param:
        msg = param + msg[len(field_name):]
    return bad_request(msg, param=param)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
ERROR_ID_PREFIX = "err_"


def client_text(value: str, limit: int = 80) -> str:
    """Safe to echo: no ANSI escapes, control characters and lone surrogates as \\uXXXX (so the
    body always encodes), at most `limit` characters."""
    value = _ANSI.sub("", value)
    cut = len(value) > limit
    safe = _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", value[:limit])
    return safe + ("..." if cut else "")


def new_error_id() -> str:
    return ERROR_ID_PREFIX + uuid.uuid4().hex[:16]


def logged_error(status: int, message: str, exc: BaseException, *, code: str | None = None,
                 type: str = "server_error") -> APIError:
    """Details (actor ids, pids, tracebacks) stay in the log; the client gets the log's id."""
    error_id = new_error_id()
    trace = exc if status >= 500 and not isinstance(exc, EngineDeadError) else None
    log.warning("error %s (HTTP %d): %s: %s", error_id, status, type_name(exc), exc,
                exc_info=trace)
    return APIError(status, f"{message} (error id: {error_id})", code=code, type=type)


def type_name(exc: BaseException) -> str:
    return type(exc).__name__


def _from_ray(exc: BaseException) -> bool:
    # Ray's wrappers (RayTaskError(ValueError) ...) render tracebacks, actor ids and pids.
    return type(exc).__module__.split(".")[0] == "ray"


def error_for(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ClientGone):
        return APIError(499, "client closed the request", code="client_closed_request")
    if isinstance(exc, GrammarOutputError):  # the message is the matcher's, client-safe
        return APIError(400, f"structured output: the grammar could not accept the output: "
                        f"{client_text(str(exc), 300)}", code="invalid_grammar")
    if isinstance(exc, EngineOverloadedError):
        return logged_error(429, "server is overloaded, retry later", exc,
                            type="rate_limit_error", code="engine_overloaded")
    if isinstance(exc, RequestTimeoutError):
        return logged_error(408, "request timed out", exc, type="timeout_error",
                            code="request_timeout")
    if isinstance(exc, ValueError) and not _from_ray(exc):
        return logged_error(400, f"the engine refused the request: {client_text(str(exc), 200)}",
                            exc, type="invalid_request_error")
    if isinstance(exc, EngineDeadError):
        return logged_error(503, "engine unavailable, retry later", exc,
                            code="engine_unavailable")
    return logged_error(500, "internal error", exc)


def error_response(err: APIError, retry_after_s: int) -> JSONResponse:
    headers = {}
    if err.status_code == 429 or err.code == "server_shutting_down":
        headers["Retry-After"] = str(retry_after_s)
    if err.status_code == 401:
        headers["WWW-Authenticate"] = BEARER_CHALLENGE
    return ASCIIJSONResponse(err.body(), status_code=err.status_code, headers=headers or None)


BEARER_CHALLENGE = 'Bearer realm="specrelay"'  # RFC 6750


class ASCIIJSONResponse(JSONResponse):
    """Encodes whatever string a body holds."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")


class HealthReasons:
    """/health is unauthenticated: it shows the reason up to its first colon and an error id
    under which the full text is logged once."""

    def __init__(self) -> None:
        self.last_full = ""
        self.last_id = ""

    def short(self, reason: str) -> str:
        head = reason.split(":", 1)[0].split("\n", 1)[0]
        if head == reason and len(reason) <= 80:
            return client_text(reason)
        if reason != self.last_full:
            self.last_full, self.last_id = reason, new_error_id()
            log.warning("health %s: %s", self.last_id, reason)
        return f"{client_text(head, 60)} (error id: {self.last_id})"
