"""The engine deployment: each Serve replica owns one whole engine (an Engine actor with its
verifier ranks in their own placement group, its draft and output actors) and streams one
request's deltas per `generate(call)` call from the ingress (actors/serve_app.py).

- Its Engine actor is named `specrelay-engine:<app>:<replica id>` (actors/replica_client.py),
  so the ingress can ask every replica for stats and health, not one the router picks.
- A cancelled call (the ingress's client went away, a timeout) raises CancelledError inside the
  generator; the relay stops reading (pipeline.output.coalesce) and EngineClient aborts the
  engine request on the way out.
- An engine error ends only this replica's requests and keeps its type (429, 400, 503, 504 at
  the ingress as before); a dead Engine actor fails `check_health`, and Serve replaces the
  replica (its new engine starts with an empty cache; prefix routing re-learns).
- On scale-down or SIGTERM Serve stops routing to the replica and waits up to
  graceful_shutdown_timeout_s for its streams to end before `__del__` stops the engine.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from actors.engine import start_engine
from actors.engine_client import EngineClient
from actors.replica_client import engine_actor_name
from actors.serve_common import (
    DRAIN_GRACE_S,
    MAX_ONGOING_REQUESTS,
    loopback_replica_grpc,
    resolve_config_path,
)
from actors.stage_groups import remove_orphan_stage_groups, remove_stage_groups
from pipeline.config import load_config
from pipeline.output.coalesce import coalesce
from pipeline.output.delta_codec import encode_deltas
from pipeline.protocol.engine_call import EngineCall
from pipeline.tracing.otel import (
    context_from_traceparent,
    flush_tracing,
    get_tracer,
    setup_tracing,
)

log = logging.getLogger(__name__)


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=5, health_check_timeout_s=60,
                  graceful_shutdown_timeout_s=DRAIN_GRACE_S, graceful_shutdown_wait_loop_s=1)
class EngineReplica:
    """One engine replica; the Engine actor is owned by, and dies with, the replica actor."""

    async def __init__(self, config_path: str | None, overrides: dict[str, Any]) -> None:
        loopback_replica_grpc()
        config = load_config(resolve_config_path(config_path), overrides)
        setup_tracing("specrelay-replica", config.tracing, register_global=False)
        context = serve.get_replica_context()
        self.replica = context.replica_tag
        self.engine_name = name = engine_actor_name(context.app_name, self.replica)
        # start_engine blocks (model loads): keep the replica's loop free.
        self.engine = await asyncio.to_thread(start_engine, config, name)
        self.client = EngineClient(self.engine)
        self._context = contextvars.copy_context()  # not a request's: Ray cancels those' calls

    async def generate(self, call: EngineCall, channel: str | None = None
                       ) -> AsyncIterator[bytes | str]:
        """With `channel` (the ingress's): the request goes to this replica's engine with its
        deltas on that channel, straight to the ingress (pipeline.engine.relay); this stream
        yields the engine's actor name once the engine has queued the request, then ends when
        the request has (so Serve counts it while it runs), or raises the engine's refusal.
        Without: the request's deltas as msgpack delta messages (pipeline.output.delta_codec),
        each with every delta that arrived since the last one was sent."""
        span = get_tracer().start_span(
            "spec.replica.request", context=context_from_traceparent(call.traceparent),
            attributes={"request.id": call.rid, "serve.replica": self.replica})
        try:
            if channel is not None:
                try:
                    # Named once queued, so the ingress knows every choice is in (or refused)
                    # before it sends headers.
                    await self.engine.queue.remote(call, channel)
                    yield self.engine_name
                    await self.engine.wait.remote(call.rid)
                except asyncio.CancelledError:
                    # Sent after `queue` by the same caller, so it finds the request (the
                    # ingress's own abort can overtake it), outside this cancelled call.
                    self._context.run(self.engine.abort.remote, call.rid)
                    raise
                return
            async for batch in coalesce(self.client.generate(call)):
                yield encode_deltas(batch)
        finally:
            span.end()

    async def health(self) -> dict[str, Any]:
        return await self.client.health()

    async def stats(self) -> dict[str, Any]:
        return await self.client.stats()

    async def model_info(self) -> dict[str, Any]:
        return await self.client.model_info()

    async def engine_actor(self) -> Any:
        """The Engine actor's handle (operations and failure tests)."""
        return self.engine

    async def check_health(self) -> None:
        # Only a dead engine actor fails the replica (Serve restarts it); an engine that is
        # rebuilding its stages reports unhealthy on /health but recovers by itself.
        try:
            await asyncio.wait_for(self.engine.health.remote(), 30)
        except ray.exceptions.ActorDiedError:
            # its placement group outlives it (remove_stage_groups): free it for the replacement
            await asyncio.to_thread(remove_stage_groups, self.engine)
            raise
        # and so do those of engines whose replica was killed before it could clean up
        try:
            await asyncio.to_thread(remove_orphan_stage_groups)
        except Exception as e:  # noqa: BLE001 - a sweep that fails is tried again next check
            log.warning("removing the placement groups of dead engines: %s", e)

    async def __del__(self) -> None:
        # Replica shutdown: stop the engine so its stage actors and placement group go too;
        # the engine and its output actor export their spans first, then this replica does.
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                await asyncio.wait_for(engine.shutdown.remote(), 30)
            except Exception as e:  # noqa: BLE001 - killed below either way
                log.warning("engine shutdown: %s", e)
            ray.kill(engine, no_restart=True)
            await asyncio.to_thread(remove_stage_groups, engine)  # left by one that died
        await asyncio.to_thread(flush_tracing)
