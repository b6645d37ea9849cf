"""OpenAI error bodies: `APIError`, the 400s built from validation failures, and the mapping of
engine exceptions to HTTP statuses.

Every error the front end returns renders as `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pipeline.errors import EngineDeadError, EngineOverloadedError, RequestTimeoutError


@dataclass
class APIError(Exception):
    """An error with its HTTP status and OpenAI error body fields."""

    status_code: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class ClientGone(Exception):
    """The HTTP client disconnected."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "function-after"}


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    # ("messages", 0, "role") -> "messages[0].role"; union tags such as "list[int]" are dropped
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


# Our SamplingParams field names -> the OpenAI parameter the user actually sent.
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def from_params_error(err: ValueError, renames: dict[str, str] | None = None) -> APIError:
    msg = str(err)
    field_name = msg.split(":", 1)[0].strip() if ":" in msg else None
    names = {**_PARAM_NAMES, **(renames or {})}
    param = names.get(field_name, field_name) if field_name else None
    if param and field_name and field_name != param:
        msg = param + msg[len(field_name):]
    return bad_request(msg, param=param)


def error_for(exc: BaseException) -> APIError:
    """The HTTP error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(429, f"server is overloaded, retry later: {exc}",
                        type="rate_limit_error", code="engine_overloaded")
    if isinstance(exc, RequestTimeoutError):
        return APIError(408, f"request timed out: {exc}", type="timeout_error",
                        code="request_timeout")
    if isinstance(exc, ValueError):  # the engine refused the request itself (prompt ids ...)
        return bad_request(str(exc))
    if isinstance(exc, ClientGone):
        return APIError(499, "client closed the request", code="client_closed_request")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"engine unavailable: {exc}", type="server_error",
                        code="engine_unavailable")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def error_response(err: APIError, retry_after_s: int) -> JSONResponse:
    retry = err.status_code == 429 or err.code == "server_shutting_down"
    headers = {"Retry-After": str(retry_after_s)} if retry else None
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)
