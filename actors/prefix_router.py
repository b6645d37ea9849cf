"""Prefix-affinity routing for the engine deployment, on Ray Serve 2.60's request-router API.

Which router and why: our own thin `RequestRouter` over pipeline/routing/prefix_affinity.py,
not `ray.serve.llm.PrefixCacheAffinityRouter`. Ray's matches the request's `prompt`/`messages`
text in a character tree held by a detached actor, queried with blocking `ray.get` calls on
every request (the router's event loop waits, and each request pays extra hops before its first
token); and a character prefix does not correspond to the engine's KV blocks. This one matches
chained hashes of whole `block_size`-token blocks of the EngineCall's prompt token ids (what the
engine's prefix cache keys), in the router's own process. When no replica holds a block of the
prompt, or the replicas' queue lengths differ by more than `imbalance_threshold`, it gives the
choice to Ray's power of two choices. Dead or removed replicas are forgotten, so a restarted
replica's empty cache is not counted on: affinity re-learns from the next requests.

Each process that holds a handle to the engine deployment (the ingress replicas) has its own
router and so its own table.
"""

from __future__ import annotations

from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from pipeline.protocol.engine_call import EngineCall
from pipeline.routing.prefix_affinity import DEFAULT_MAX_BLOCKS, PrefixAffinity

ROUTER_PATH = "actors.prefix_router:PrefixAffinityRouter"


def engine_call_of(pending: PendingRequest | None) -> EngineCall | None:
    if pending is None or not pending.args:
        return None
    call = pending.args[0]
    return call if isinstance(call, EngineCall) else None


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Not FIFO on purpose: the replica chosen for a request's prefix must serve that request
    (RequestRouter's default fulfils exactly the request a routing task chose for)."""

    def initialize_state(self, block_size: int = 16, imbalance_threshold: int = 8,
                         max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.affinity = PrefixAffinity(block_size, imbalance_threshold, max_blocks)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas=candidate_replicas, pending_request=pending_request)
        call = engine_call_of(pending_request)
        if call is None or len(candidate_replicas) < 2 or not fallback:
            return fallback
        keys = self.affinity.keys(call.prompt_ids)
        if not keys:
            return fallback
        loads = await self._queue_lens(candidate_replicas)
        chosen = self.affinity.choose(keys, loads)
        if chosen is None or chosen not in self._replicas:
            return fallback
        return [[self._replicas[chosen]], *fallback]

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests in flight per replica: the router's cache, probing those it lacks (as Ray's
        own routers do); a replica that does not answer is left out."""
        loads: dict[ReplicaID, int] = {}
        missing = []
        for r in replicas:
            cached = (self._replica_queue_len_cache.get(r.replica_id)
                      if self._use_replica_queue_len_cache else None)
            if cached is None:
                missing.append(r)
            else:
                loads[r.replica_id] = cached
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                if n is not None:
                    loads[r.replica_id] = n
        return loads

    def _fulfill_next_pending_request(self, replica: RunningReplica,
                                      request_metadata: Any = None) -> None:
        """Give the replica to exactly the request it was chosen for. Ray's default finds that
        request by its internal request id, which every handle call made while serving one
        HTTP request shares (the choices of an n > 1 request): all but one would never be
        routed. The routing task passes the request's own metadata object, so match on it."""
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._cancel_routing_task_for_pending_request(pending)
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                self._remove_pending_request_from_indices(pending)
                return

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        call = engine_call_of(pending_request)
        if call is not None:
            self.affinity.record(replica_id, self.affinity.keys(call.prompt_ids))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.affinity.keep_only(r.replica_id for r in replicas)
