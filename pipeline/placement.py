"""The `placement:` config section: where the engine's actors go on a multi-node Ray cluster (the
TP ranks' placement-group strategy, custom resources per actor), as plain data for actors/."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
# Ray sets these from num_cpus / num_gpus / memory options; a custom resource must not name them.
_BUILTIN = ("CPU", "GPU", "memory", "object_store_memory")


@dataclass(frozen=True)
class Placement:
    verifier_strategy: str = "PACK"
    verifier_resources: dict[str, float] = field(default_factory=dict)
    draft_resources: dict[str, float] = field(default_factory=dict)
    output_resources: dict[str, float] = field(default_factory=dict)
    engine_resources: dict[str, float] = field(default_factory=dict)

    def verifier_bundles(self, world: int, gpu: bool) -> list[dict[str, float]]:
        base: dict[str, float] = {"CPU": 1, **({"GPU": 1} if gpu else {})}
        return [{**base, **self.verifier_resources} for _ in range(world)]


def parse_placement(raw: Mapping[str, Any] | None) -> Placement:
    if raw is None:
        return Placement()
    if not isinstance(raw, Mapping):
        raise ValueError("placement: must be a mapping")  # noqa: TRY004 - config errors are ValueErrors
    known = {f for f in Placement.__dataclass_fields__}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"placement: unknown key(s) {', '.join(map(str, unknown))} "
                         f"(known: {', '.join(sorted(known))})")
    strategy = raw.get("verifier_strategy", "PACK")
    if strategy not in STRATEGIES:
        raise ValueError(f"placement.verifier_strategy: must be one of {', '.join(STRATEGIES)}, "
                         f"got {strategy!r}")
    resources = {key: _resources(f"placement.{key}", raw.get(key))
                 for key in known if key.endswith("_resources")}
    return Placement(verifier_strategy=strategy, **resources)


def _resources(name: str, value: Any) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}: must be a mapping of resource name to amount")  # noqa: TRY004
    out: dict[str, float] = {}
    for key, amount in value.items():
        if not isinstance(key, str) or not key or key in _BUILTIN:
            raise ValueError(f"{name}: {key!r} is not a custom resource name "
                             f"(CPU and GPU are set by the engine)")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise ValueError(f"{name}.{key}: must be a positive number, got {amount!r}")
        if amount > 1 and amount != int(amount):  # Ray's rule for resource quantities
            raise ValueError(f"{name}.{key}: above 1 must be a whole number, got {amount!r}")
        out[key] = float(amount)
    return out
