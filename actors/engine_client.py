"""Async client over the Engine actor handle: the only place the front end touches Ray.

Engine errors arrive wrapped in `ray.exceptions.RayTaskError`; the client unwraps them so callers
see `EngineOverloadedError`, `EngineDeadError` and `RequestTimeoutError` from pipeline.errors. An
actor that died (RayActorError) or an unreachable object becomes EngineDeadError.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from pipeline.errors import EngineDeadError
from pipeline.frontend.background import fire_and_forget
from pipeline.output.request_output import RequestOutput
from pipeline.protocol.engine_call import EngineCall, as_engine_call


def unwrap(exc: BaseException) -> BaseException:
    """The engine's own exception inside a Ray wrapper; Ray-level failures -> EngineDeadError."""
    import ray.exceptions as rex

    if isinstance(exc, rex.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return unwrap(cause)
        try:
            return exc.as_instanceof_cause()
        except Exception:  # noqa: BLE001 - an unusual wrapper: keep the original
            return exc
    if isinstance(exc, (rex.RayActorError, rex.ObjectLostError, rex.WorkerCrashedError)):
        return EngineDeadError(f"engine actor unavailable: {exc}")
    return exc


class EngineClient:
    """What the HTTP app needs from an engine; the same API as tests' fake engine."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def generate(self, call: EngineCall | str, *legacy: Any,
                       **legacy_kw: Any) -> AsyncIterator[RequestOutput]:
        """The request's deltas from the Engine actor; closing early aborts it there.
        (`legacy`: the positional form scripts/bench_*.py still use, `as_engine_call`.)"""
        call = as_engine_call(call, *legacy, **legacy_kw)
        rid = call.rid
        gen = self.handle.generate.remote(call)
        finished = False
        try:
            async for ref in gen:
                try:
                    out: RequestOutput = await ref
                except Exception as e:  # noqa: BLE001 - re-raised as the engine's own error
                    raise unwrap(e) from None
                finished = out.finished
                yield out
                if finished:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - errors raised while advancing the generator
            raise unwrap(e) from None
        finally:
            if not finished:
                # Closed early (client gone, timeout, error): free the request's slots.
                fire_and_forget(self.abort(rid))

    async def abort(self, rid: str) -> None:
        try:
            await self.handle.abort.remote(rid)
        except Exception as e:  # noqa: BLE001 - aborting a dead engine is not an error
            if not isinstance(unwrap(e), EngineDeadError):
                raise unwrap(e) from None

    async def stats(self) -> dict[str, Any]:
        return await self._call("stats")

    async def health(self) -> dict[str, Any]:
        return await self._call("health")

    async def model_info(self) -> dict[str, Any]:
        return await self._call("model_info")

    async def _call(self, method: str) -> Any:
        try:
            return await getattr(self.handle, method).remote()
        except Exception as e:  # noqa: BLE001
            raise unwrap(e) from None
