"""What an engine's stage actors need from the cluster, as plain data: the resources of each stage
(actors/engine.py turns them into Ray actor options and one placement group), the same in words
for start-up messages, and the names of the stages' placement groups. No Ray here.

One verifier per tensor-parallel rank, each in its own bundle of a placement group (one CPU, and
one GPU on cuda); the draft actor takes a GPU only for a draft model on cuda; the output and
engine actors take no CPU or GPU, only the custom resources `placement:` gives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.config import EngineConfig

GROUP_PREFIX = "specrelay-stages"


@dataclass(frozen=True)
class StageResources:
    verifier_strategy: str  # the placement group's strategy (PACK, STRICT_PACK, ...)
    verifier_bundles: list[dict[str, float]]  # one per TP rank
    verifier_gpus: int  # per rank
    draft_gpus: int
    draft_resources: dict[str, float]
    output_resources: dict[str, float]
    engine_resources: dict[str, float]

    def describe(self) -> str:
        """In words, for start-up messages and the start timeout's error."""
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
    """The cluster resources an engine waits for, in words (for start-up messages)."""
    return stage_resources(config).describe()


def stage_group_prefix(engine_id: str) -> str:
    """The name of every stage placement group of the Engine actor `engine_id`, but its build."""
    return f"{GROUP_PREFIX}:{engine_id}:"


def stage_group_name(engine_id: str, build: int) -> str:
    """Each (re)build's group has a name of its own: a rebuild never waits on the old one's."""
    return f"{stage_group_prefix(engine_id)}{build}"


def live_stage_groups(table: Mapping[str, Mapping[str, Any]], engine_id: str) -> list[str]:
    """The ids of the groups in `table` (Ray's placement_group_table: id -> row with `name` and
    `state`) that the Engine actor `engine_id` made and that are not removed yet."""
    prefix = stage_group_prefix(engine_id)
    return [pg_id for pg_id, row in table.items()
            if row["name"].startswith(prefix) and row["state"] != "REMOVED"]
