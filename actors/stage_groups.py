"""Removing the placement groups of Engine actors that are gone. Ray frees a group made by an
actor only once that actor and its job have both ended, and a Serve replica's job is the one that
started Serve: an engine killed by a signal, or with its replica, kept its verifier CPUs/GPUs
reserved, and its replacement could wait for them."""

from __future__ import annotations

import contextlib
from typing import Any

import ray
from ray._private import state  # the GCS actor table: works without the dashboard's state API
from ray.util.placement_group import PlacementGroup, remove_placement_group

from pipeline.engine.stage_resources import live_stage_groups, orphan_stage_groups


def remove_stage_groups(engine: Any) -> int:
    """Remove what is left of the groups the Engine actor `engine` made; returns how many."""
    return _remove(live_stage_groups(ray.util.placement_group_table(), engine._actor_id.hex()))


def remove_orphan_stage_groups() -> int:
    """Remove the groups of every Engine actor that has died (one force-killed with its replica
    after the graceful-stop timeout never ran its own cleanup); returns how many."""
    return _remove(orphan_stage_groups(ray.util.placement_group_table(), _is_dead))


def _is_dead(actor_id: str) -> bool:
    return state.actors(actor_id=actor_id).get("State") == "DEAD"


def _remove(groups: list[str]) -> int:
    for pg_id in groups:
        with contextlib.suppress(Exception):  # removed meanwhile
            remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
    return len(groups)
