"""What an engine's stage actors need from the cluster, as plain data (actors/engine.py turns it
into Ray options), and the names of their placement groups."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.config import EngineConfig

GROUP_PREFIX = "specrelay-stages"


@dataclass(frozen=True)
class StageResources:
    verifier_strategy: str
    verifier_bundles: list[dict[str, float]]
    verifier_gpus: int
    draft_gpus: int
    draft_resources: dict[str, float]
    output_resources: dict[str, float]
    engine_resources: dict[str, float]

    def describe(self) -> str:
        return (f"a {self.verifier_strategy} placement group of {len(self.verifier_bundles)} "
                f"bundle(s) {self.verifier_bundles} for the verifier ranks, a draft actor "
                f"(GPU: {self.draft_gpus}, {self.draft_resources or 'no custom resources'}), "
                f"an output actor ({self.output_resources or 'no custom resources'}) and the "
                f"engine actor ({self.engine_resources or 'no custom resources'})")


def stage_resources(config: EngineConfig) -> StageResources:
    gpu = config.device.startswith("cuda")
    place = config.placement_spec
    return StageResources(
        verifier_strategy=place.verifier_strategy,
        verifier_bundles=place.verifier_bundles(config.tensor_parallel_size, gpu),
        verifier_gpus=1 if gpu else 0,
        draft_gpus=1 if gpu and config.draft == "model" else 0,
        draft_resources=place.draft_resources,
        output_resources=place.output_resources,
        engine_resources=place.engine_resources,
    )


def engine_needs(config: EngineConfig) -> str:
    return stage_resources(config).describe()


def stage_group_prefix(engine_id: str) -> str:
    return f"{GROUP_PREFIX}:{engine_id}:"


def stage_group_name(engine_id: str, build: int) -> str:
    # a name per (re)build: a rebuild never waits on the old group
    return f"{stage_group_prefix(engine_id)}{build}"


def live_stage_groups(table: Mapping[str, Mapping[str, Any]], engine_id: str) -> list[str]:
    prefix = stage_group_prefix(engine_id)
    return [pg_id for pg_id, row in table.items()
            if row["name"].startswith(prefix) and row["state"] != "REMOVED"]


def engine_of_group(name: str) -> str | None:
    """The engine actor id in a stage group's name (None: not a stage group)."""
    prefix, _, rest = name.partition(":")
    engine_id = rest.rpartition(":")[0]
    return engine_id if prefix == GROUP_PREFIX and engine_id else None


def orphan_stage_groups(table: Mapping[str, Mapping[str, Any]],
                        is_dead: Callable[[str], bool]) -> list[str]:
    """The stage groups not yet removed whose engine actor is dead (`is_dead` asked once per
    engine)."""
    dead: dict[str, bool] = {}
    groups = []
    for pg_id, row in table.items():
        engine_id = engine_of_group(row["name"])
        if engine_id is None or row["state"] == "REMOVED":
            continue
        if engine_id not in dead:
            dead[engine_id] = is_dead(engine_id)
        if dead[engine_id]:
            groups.append(pg_id)
    return groups

