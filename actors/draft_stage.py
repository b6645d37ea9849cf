"""RayDraft: the engine's DraftWorker actor, replaced in the background when it dies.

The policy (what a step sends the draft, what a step does without one, the catch-up plan) is
pipeline.engine.draft_failover's; this module only starts actors and reads Ray's errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from pipeline.config import EngineConfig
from pipeline.engine.draft_failover import DraftFailover, describe
from pipeline.engine.stage_resources import StageResources, stage_resources
from pipeline.protocol import StepPlan, encode_plan

if TYPE_CHECKING:
    from actors.stage_actors import StageActors

log = logging.getLogger(__name__)

RETRY_S = (1.0, 30.0)  # a replacement that failed to start is tried again: first wait, most


def start_draft(config: EngineConfig, need: StageResources | None = None) -> Any:
    """A new DraftWorker actor, placed as `config.placement` says (not yet answering)."""
    from actors.draft import DraftWorker  # lazy: it imports torch

    need = need or stage_resources(config)
    return ray.remote(DraftWorker).options(
        num_cpus=0, num_gpus=need.draft_gpus, max_restarts=0,
        resources=need.draft_resources).remote(config)


class RayDraft:
    """The draft stage of one build: `actors.draft` is its current actor. `call(method, *args)`
    submits a call as the engine's own (RayStages._call)."""

    def __init__(self, config: EngineConfig, actors: StageActors,
                 call: Callable[..., Any]) -> None:
        self.config = config
        self.actors = actors
        self.failover = DraftFailover()
        self._call = call
        self._replacing: asyncio.Task | None = None
        self._lost_at = 0.0
        self.replacements = 0
        self.downtime_s: float | None = None  # the last loss until its replacement answered

    def propose(self, plans: list[StepPlan], plan_bytes: bytes) -> Any:
        """Send `plans` (the step's own last, already encoded as `plan_bytes`) to the draft
        actor; the last one's proposal ref."""
        for plan in plans[:-1]:  # a catch-up plan: its (empty) proposal is not needed
            self._call(self.actors.draft.propose, encode_plan(plan))
        return self._call(self.actors.draft.propose, plan_bytes)

    async def died(self, proposal: Any) -> bool:
        """Whether `proposal` failed because the draft actor died (then replace it)."""
        try:
            await proposal
        except ray.exceptions.RayActorError:
            self.lose()
            return True
        except Exception:  # noqa: BLE001 - the draft's own error: not a loss, the step fails
            return False
        return False

    async def ping(self) -> None:
        """Ping the draft actor when it is live; a dead one is replaced (the engine stays up)."""
        if not self.failover.live:
            return
        try:
            await self._call(self.actors.draft.ping)
        except ray.exceptions.RayActorError:
            self.lose()

    def lose(self) -> None:
        """The draft actor is gone: steps go on without drafts while a new one starts."""
        if self._replacing is not None or self.actors.closed:
            return
        log.warning("draft actor lost: verifying without drafts while a new one starts")
        self.failover.lost()
        self._lost_at = time.monotonic()
        with contextlib.suppress(Exception):  # already gone; a merely unreachable one must go
            ray.kill(self.actors.draft, no_restart=True)
        self._replacing = asyncio.get_running_loop().create_task(self._replace())

    async def _replace(self) -> None:
        wait = RETRY_S[0]
        try:
            while not self.actors.closed:
                handle = start_draft(self.config)
                self.actors.starting.append(handle)
                try:
                    await self._call(handle.ping)  # answers once its proposer is built
                except Exception as e:  # noqa: BLE001 - died while starting: try again
                    log.warning("draft actor replacement failed (%s); again in %.0fs", e, wait)
                    self._drop(handle)
                    await asyncio.sleep(wait)
                    wait = min(2 * wait, RETRY_S[1])
                    continue
                if self.actors.closed:  # the build was killed meanwhile (kill() got it too)
                    return
                self.actors.starting.remove(handle)
                self.actors.draft = handle
                self.failover.replaced()
                self.replacements += 1
                self.downtime_s = time.monotonic() - self._lost_at
                log.warning("draft actor replaced after %.1fs", self.downtime_s)
                return
        finally:
            self._replacing = None

    def _drop(self, handle: Any) -> None:
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)
        with contextlib.suppress(ValueError):
            self.actors.starting.remove(handle)

    def stats(self) -> dict[str, Any]:
        return {**describe(self.failover), "draft_replacements": self.replacements,
                "draft_downtime_s": self.downtime_s}
