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
from ray.util.placement_group import remove_placement_group

from actors.draft_stage import start_draft
from pipeline.config import EngineConfig
from pipeline.engine.stage_rebuild import Replace, stages_to_replace
from pipeline.engine.stage_resources import StageResources, stage_resources


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
    need = stage_resources(config)
    pg = await _new_group(need, group_name, report)
    started: list[Any] = []
    try:
        started += _start_verifiers(config, need, pg)
        started += [start_draft(config, need), _start_output(config, need)]
        *verifiers, draft, output = started
        info = await _loaded(need, report, verifiers, output, draft)
    except BaseException:
        _discard(started, pg)  # a half-started build leaves nothing behind
        raise
    return StageActors(draft, verifiers, output, pg, info)


async def reset_survivors(actors: StageActors, call: Callable[..., Any], draft_live: bool,
                          timeout_s: float) -> Replace:
    """Ask every stage of a failed build to forget its requests (`call(method)` submits as the
    engine); which to replace: those that did not answer (pipeline.engine.stage_rebuild)."""
    return await stages_to_replace(
        call(actors.draft.reset) if draft_live else None,
        [call(v.reset) for v in actors.verifiers], call(actors.output.reset), timeout_s)


async def replace_stages(config: EngineConfig, old: StageActors, replace: Replace,
                         report: Callable[[str], None] = lambda _: None,
                         group_name: str = "") -> StageActors:
    """The stage actors of the next build: `old`'s that are kept (already reset), new ones for
    the rest. New verifier ranks get a new placement group named `group_name` (`old`'s is
    removed): a group that still reads as placed may hold a bundle on a node that is gone and
    not yet noticed."""
    old.closed = True  # its draft replacements (if any) stop; the kept actors live on
    gone = [*old.starting, *([old.draft] if replace.draft else []),
            *(old.verifiers if replace.verifiers else []), *([old.output] if replace.output else [])]
    for actor in gone:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(actor, no_restart=True)
    need = stage_resources(config)
    pg, verifiers = old.placement_group, old.verifiers
    new: list[Any] = []
    new_pg = None
    try:
        if replace.verifiers:
            with contextlib.suppress(Exception):  # already removed (an earlier attempt)
                remove_placement_group(pg)
            pg = new_pg = await _new_group(need, group_name, report)
            verifiers = _start_verifiers(config, need, pg)
            new += verifiers
        draft = start_draft(config, need) if replace.draft else old.draft
        output = _start_output(config, need) if replace.output else old.output
        new += [a for a, r in ((draft, replace.draft), (output, replace.output)) if r]
        info = await _loaded(need, report, verifiers if replace.verifiers else [],
                             output if replace.output else None,
                             draft if replace.draft else None)
    except BaseException:
        _discard(new, new_pg)  # a half-started build leaves nothing behind
        raise
    return StageActors(draft, verifiers, output, pg, {**old.info, **info})


def _discard(actors: list[Any], pg: Any | None) -> None:
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    if pg is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)


async def _new_group(need: StageResources, name: str, report: Callable[[str], None]) -> Any:
    from ray.util.placement_group import placement_group

    pg = placement_group(need.verifier_bundles, strategy=need.verifier_strategy, name=name)
    report(f"waiting for the verifier placement group ({need.verifier_strategy} "
           f"{need.verifier_bundles})")
    try:
        await pg.ready()
    except BaseException:  # cancelled (the engine shuts down): not left pending in the cluster
        _discard([], pg)
        raise
    return pg


def _start_verifiers(config: EngineConfig, need: StageResources, pg: Any) -> list[Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # lazy: the stage actors import torch; the engine actor and the Serve replica that import
    # this module need only their classes, here
    from actors.verifier import TargetVerifier

    return [
        ray.remote(TargetVerifier).options(
            num_cpus=1, num_gpus=need.verifier_gpus, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank)).remote(config, rank)
        for rank in range(config.tensor_parallel_size)
    ]


def _start_output(config: EngineConfig, need: StageResources) -> Any:
    from actors.output import OutputActor  # lazy, as above

    return ray.remote(OutputActor).options(
        num_cpus=0, max_restarts=0, resources=need.output_resources).remote(config)


async def _loaded(need: StageResources, report: Callable[[str], None], verifiers: list[Any],
                  output: Any | None, draft: Any | None) -> dict[str, Any]:
    """Wait for the started actors to load (the ranks join their process group first); the
    model facts they report."""
    report(f"waiting for the stage actors (draft {need.draft_resources}, "
           f"output {need.output_resources}) to start and load")
    init = None
    if len(verifiers) > 1:
        init = await verifiers[0].rendezvous_address.remote()
    loaded = await asyncio.gather(*(v.load.remote(init) for v in verifiers))
    out_info = await output.info.remote() if output is not None else {}
    if draft is not None:
        await draft.ping.remote()
    return {**(loaded[0] if loaded else {}), **out_info}
