"""The ingress's engine client over the engine deployment (actors/engine_replica.py): the same
API as EngineClient (`generate`, `abort`, `stats`, `health`, `model_info`), so the HTTP app
(pipeline/frontend/app.py) does not know whether one engine or many serve it.

- `generate` sends an EngineCall through the deployment handle: Serve's request router (prefix
  affinity or power of two choices) picks the replica, which names its Engine actor and queues
  the request there with this ingress's channel; the deltas come back from the Engine actor on
  one stream per engine for all of this ingress's requests (pipeline.engine.relay), and the
  handle call ends with the request. Closing early (client gone, timeout) aborts the request in
  its engine and cancels the handle call.
- `stats` and `health` must reach every replica, not one the router picks: each replica names
  its Engine actor `specrelay-engine:<app>:<replica>`, and the directory finds them by name.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray

from actors.engine_client import EngineClient, Relay, unwrap
from pipeline.engine.relay import Demux
from pipeline.errors import EngineDeadError
from pipeline.frontend.background import fire_and_forget
from pipeline.frontend.replica_stats import merge_health, merge_stats
from pipeline.output.request_output import RequestOutput
from pipeline.protocol.engine_call import EngineCall

ENGINE_NAME_PREFIX = "specrelay-engine"
# How long one replica's stats / health answer may take: under the app's own health and stats
# timeouts (ServerSettings, 2 s), so one slow replica (a new one still starting its actor) is
# reported unhealthy instead of failing the whole answer.
TIMEOUT_S = {"health": 1.0, "stats": 1.5}


def engine_actor_name(app: str, replica: str) -> str:
    return f"{ENGINE_NAME_PREFIX}:{app}:{replica}"


class EngineDirectory:
    """The Engine actors of one application's replicas, found by their names (a replica that
    is gone drops out of Ray's named-actor list; a new one appears under its own id)."""

    def __init__(self, app: str) -> None:
        self.prefix = engine_actor_name(app, "")
        self._handles: dict[str, Any] = {}

    async def engines(self) -> dict[str, Any]:
        """{replica id: Engine actor handle}, sorted by replica id."""
        named = await asyncio.to_thread(ray.util.list_named_actors, True)
        found: dict[str, Any] = {}
        for entry in named:
            name = entry["name"]
            if not name.startswith(self.prefix):
                continue
            replica = name[len(self.prefix):]
            handle = self._handles.get(replica)
            if handle is None:
                try:
                    handle = await asyncio.to_thread(ray.get_actor, name, entry["namespace"])
                except ValueError:  # died between the listing and the lookup
                    continue
            found[replica] = handle
        self._handles = dict(sorted(found.items()))
        return self._handles


class ReplicaClient:
    """What the HTTP app needs from the engines, over the engine deployment's handle."""

    def __init__(self, handle: Any, directory: EngineDirectory) -> None:
        self.handle = handle
        self.stream = handle.options(stream=True)
        self.directory = directory
        self._streams: dict[str, Any] = {}  # rid -> its handle call (abort cancels it)
        # deltas come straight from the engines: one channel (a stream per engine) and one
        # demultiplexer for every request of this ingress
        self._channel = uuid.uuid4().hex
        self._demux = Demux()
        self._relays: dict[str, Relay] = {}  # engine actor name -> its stream
        self._last_stats: dict[str, dict[str, Any]] = {}

    async def generate(self, call: EngineCall) -> AsyncIterator[RequestOutput]:
        """The request through the router to a replica, its deltas straight from that replica's
        Engine actor on this ingress's channel (one stream per ingress and engine, whatever the
        batch: pipeline.engine.relay). The handle call lasts as long as the request (Serve's
        ongoing count, its queue limit and autoscaling see it) and carries its refusal."""
        rid = call.rid
        queue = self._demux.open(rid)
        response = self.stream.generate.remote(call, self._channel)
        self._streams[rid] = response
        finished = False
        relay: Relay | None = None
        watcher: asyncio.Future | None = None
        try:
            try:
                name = await response.__anext__()
                relay = await self._relay_to(name)
            except StopAsyncIteration:
                raise EngineDeadError("the engine replica ended the request unanswered") from None
            except Exception as e:  # noqa: BLE001 - the engine's own error, or the replica died
                raise unwrap(e) from None
            relay.rids.add(rid)
            if relay.reader.done():  # the engine's stream failed before this request joined it
                raise EngineDeadError(f"engine {name} is gone")
            watcher = asyncio.ensure_future(_watch(response, queue))
            yield RequestOutput(rid)  # queued (see EngineClient.generate)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item  # (the abort below is a no-op if the engine ended it)
                finished = item.finished
                yield item
        finally:
            self._demux.close(rid)
            self._streams.pop(rid, None)
            if watcher is not None:
                watcher.cancel()
            if relay is not None:
                relay.rids.discard(rid)
            if not finished:  # closed early: end the request in its engine and the handle call
                response.cancel()
                if relay is not None:
                    fire_and_forget(EngineClient(relay.handle).abort(rid))

    async def _relay_to(self, engine_name: str) -> Relay:
        """The stream of `engine_name`'s deltas for this ingress (made on first use, and again
        after the engine's stream failed)."""
        loop = asyncio.get_running_loop()

        def usable(relay: Relay | None) -> bool:
            return relay is not None and not relay.reader.done() and relay.loop is loop

        relay = self._relays.get(engine_name)
        if usable(relay):
            return relay
        handle = (await self.directory.engines()).get(engine_name[len(self.directory.prefix):])
        if handle is None:
            raise EngineDeadError(f"engine {engine_name} is not running")
        # Again after the lookup: a concurrent request may have made it meanwhile, and a second
        # stream of one channel would take some of its messages, out of order with the first's.
        relay = self._relays.get(engine_name)
        if not usable(relay):
            relay = self._relays[engine_name] = Relay(handle, loop, self._channel, self._demux,
                                                      set())
        return relay

    async def abort(self, rid: str) -> None:
        response = self._streams.get(rid)
        if response is not None:
            response.cancel()

    async def model_info(self) -> dict[str, Any]:
        try:
            return await self.handle.model_info.remote()
        except Exception as e:  # noqa: BLE001
            raise unwrap(e) from None

    async def stats(self) -> dict[str, Any]:
        """Every replica's engine stats, merged (pipeline.frontend.replica_stats); a replica
        that does not answer keeps its last counters and reports unhealthy."""
        answers = await self._each("stats")
        per: dict[str, dict[str, Any]] = {}
        for replica, answer in answers.items():
            if isinstance(answer, BaseException):
                per[replica] = {**self._last_stats.get(replica, {}), "healthy": False}
            else:
                per[replica] = answer
        self._last_stats = per
        if not per:
            raise EngineDeadError("no engine replica is running")
        return merge_stats(per)

    async def health(self) -> dict[str, Any]:
        """Healthy while at least one replica's engine is."""
        answers = await self._each("health")
        return merge_health({
            r: {"healthy": False, "reason": f"{type(a).__name__}: {a}"}
            if isinstance(a, BaseException) else a for r, a in answers.items()})

    async def engine_actors(self) -> dict[str, Any]:
        return await self.directory.engines()

    async def _each(self, method: str) -> dict[str, Any]:
        engines = await self.directory.engines()

        async def one(handle: Any) -> Any:
            try:
                return await asyncio.wait_for(getattr(handle, method).remote(),
                                              TIMEOUT_S[method])
            except Exception as e:  # noqa: BLE001 - reported per replica
                return unwrap(e)

        answers = await asyncio.gather(*(one(h) for h in engines.values()))
        return dict(zip(engines, answers))


async def _watch(response: Any, queue: asyncio.Queue) -> None:
    """The handle call's end: an error (a refusal, the replica gone) ends the request's queue;
    a plain end says nothing (the finished delta comes on the engine's stream)."""
    try:
        async for _ in response:
            pass
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - handed to the request's reader
        queue.put_nowait(unwrap(e))
