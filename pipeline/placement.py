"""Where the engine's actors go on a multi-node Ray cluster: the `placement:` config section.

    placement:
      verifier_strategy: PACK        # the TP ranks' placement group: PACK | STRICT_PACK | SPREAD
                                     # | STRICT_SPREAD (STRICT_PACK: all ranks on one node, NCCL
                                     # over NVLink; PACK: one node when it fits, else several)
      verifier_resources: {}         # custom resources each rank's bundle also needs
      draft_resources: {}            # custom resources of the draft actor
      output_resources: {}           # ... of the output (detokenizer) actor
      engine_resources: {}           # ... of the engine (scheduler) actor

Custom resources are the ones a node declares (`ray start --resources '{"gpu_a100": 1}'`, or
KubeRay's rayStartParams `resources`); CPU and GPU are set by the code (one CPU, and one GPU per
rank on cuda). Plain data only: the Ray shells in actors/ turn it into actor options.
"""

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
        """One placement-group bundle per TP rank: a CPU, a GPU on cuda, and the custom ones."""
        base: dict[str, float] = {"CPU": 1, **({"GPU": 1} if gpu else {})}
        return [{**base, **self.verifier_resources} for _ in range(world)]


def parse_placement(raw: Mapping[str, Any] | None) -> Placement:
    """A Placement from the config mapping; ValueError naming `placement.<key>` on bad input."""
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
