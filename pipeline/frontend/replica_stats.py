"""Several engine replicas as one: stats summed (each replica's own under `replicas`) and health
(serving while any replica is)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Not additive: the worst replica's stands for the deployment.
_MAX_KEYS = frozenset({"stall_bound_s", "last_progress"})


def merge_stats(per_replica: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for stats in per_replica.values():
        for key, value in stats.items():
            merged[key] = _merge(key, merged.get(key), value)
    merged["healthy"] = any(s.get("healthy", False) for s in per_replica.values())
    merged["replicas"] = {r: dict(s) for r, s in per_replica.items()}
    return merged


def _merge(key: str, a: Any, b: Any) -> Any:
    if a is None:
        return list(b) if isinstance(b, list) else dict(b) if isinstance(b, dict) else b
    if isinstance(b, bool) or isinstance(a, bool):
        return a or b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return max(a, b) if key in _MAX_KEYS else a + b
    if isinstance(a, list) and isinstance(b, list):
        longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
        return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]
    if isinstance(a, dict) and isinstance(b, dict) and key == "step_seconds":
        return {"buckets": a["buckets"], "counts": _merge("counts", a["counts"], b["counts"]),
                "sum": a["sum"] + b["sum"]}
    return a


def merge_health(per_replica: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    if not per_replica:
        return {"healthy": False, "reason": "no engine replica is running"}
    sick = {r: h for r, h in per_replica.items() if not h.get("healthy")}
    healthy = len(sick) < len(per_replica)
    reason = "; ".join(f"replica {r}: {h.get('reason', 'unhealthy')}"
                       for r, h in sorted(sick.items()))
    return {"healthy": healthy, "reason": reason,
            "replicas_healthy": len(per_replica) - len(sick), "replicas": len(per_replica)}
