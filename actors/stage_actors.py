"""The stage actors of one engine build: a DraftWorker, one TargetVerifier per TP rank (in a
placement group) and an OutputActor, started as `config.placement` says (actors/engine.py drives
them)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.draft_stage import start_draft
from pipeline.config import EngineConfig
from pipeline.engine.stage_resources import stage_resources


@dataclass
class StageActors:
    draft: Any
    verifiers: list[Any]
    output: Any
    placement_group: Any
    info: dict[str, Any] = field(default_factory=dict)
    starting: list[Any] = field(default_factory=list)  # draft replacements not yet answering
    closed: bool = False  # killed: start no more actors

    @property
    def all(self) -> list[Any]:
        return [self.draft, *self.verifiers, self.output]

    async def flush_telemetry(self, timeout_s: float = 5.0) -> None:
        """Let the tracing stage (the output actor) export its spans before it is killed; one
        that is gone or wedged is given up on after `timeout_s`."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.output.flush_telemetry.remote(timeout_s), timeout_s + 1)

    def kill(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self.closed = True
        for actor in [*self.all, *self.starting]:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):  # already removed
            remove_placement_group(self.placement_group)


async def create_stage_actors(config: EngineConfig,
                              report: Callable[[str], None] = lambda _: None,
                              group_name: str = "") -> StageActors:
    """Start the draft, verifier ranks (one bundle each of a placement group named `group_name`)
    and output actors, placed as `config.placement` says. `report` hears what it is waiting for
    (a placement group or an actor waits until the cluster has the resources, e.g. until a lost
    node is back)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # lazy: the stage actors import torch; the engine actor and the Serve replica that import
    # this module need only their classes, here
    from actors.output import OutputActor
    from actors.verifier import TargetVerifier

    need = stage_resources(config)
    pg = placement_group(need.verifier_bundles, strategy=need.verifier_strategy, name=group_name)
    report(f"waiting for the verifier placement group ({need.verifier_strategy} "
           f"{need.verifier_bundles})")
    await pg.ready()
    verifiers = [
        ray.remote(TargetVerifier).options(
            num_cpus=1, num_gpus=need.verifier_gpus, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank)).remote(config, rank)
        for rank in range(config.tensor_parallel_size)
    ]
    draft = start_draft(config, need)
    output = ray.remote(OutputActor).options(
        num_cpus=0, max_restarts=0, resources=need.output_resources).remote(config)
    report(f"waiting for the stage actors (draft {need.draft_resources}, "
           f"output {need.output_resources}) to start and load")
    init = None
    if config.tensor_parallel_size > 1:
        init = await verifiers[0].rendezvous_address.remote()
    loaded = await asyncio.gather(*(v.load.remote(init) for v in verifiers))
    out_info = await output.info.remote()
    await draft.ping.remote()
    info = {**loaded[0], **out_info}
    return StageActors(draft, verifiers, output, pg, info)
