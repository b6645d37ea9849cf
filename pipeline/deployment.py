"""The `deployment:` config section: engine replicas, routing (`prefix` or `pow2`) and
autoscaling, as plain data; actors/serve_app.py turns it into Serve options (`autoscaling_config`
is Ray Serve's, field for field)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from pipeline import validate as check

ROUTINGS = ("prefix", "pow2")


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int = 1
    max_replicas: int = 4
    initial_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 300.0
    metrics_interval_s: float = 10.0
    look_back_period_s: float = 30.0

    def to_ray(self) -> dict[str, Any]:
        # None fields are left to Ray's defaults
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class DeploymentSettings:
    replicas: int = 1
    routing: str = "prefix"
    imbalance_threshold: int = 8
    autoscaling: Autoscaling | None = None

    @property
    def autoscaling_config(self) -> dict[str, Any] | None:
        return None if self.autoscaling is None else self.autoscaling.to_ray()


def parse_deployment(raw: Mapping[str, Any] | None) -> DeploymentSettings:
    if raw is None:
        return DeploymentSettings()
    _known("deployment", raw, DeploymentSettings)
    replicas = raw.get("replicas", 1)
    check.integer("deployment.replicas", replicas, 1)
    routing = raw.get("routing", "prefix")
    check.choice("deployment.routing", routing, ROUTINGS)
    threshold = raw.get("imbalance_threshold", 8)
    check.integer("deployment.imbalance_threshold", threshold, 0)
    auto = raw.get("autoscaling")
    return DeploymentSettings(replicas=replicas, routing=routing, imbalance_threshold=threshold,
                              autoscaling=None if auto is None else _parse_autoscaling(auto))


def _parse_autoscaling(raw: Any) -> Autoscaling:
    if not isinstance(raw, Mapping):
        raise ValueError("deployment.autoscaling: must be a mapping or null")  # noqa: TRY004
    _known("deployment.autoscaling", raw, Autoscaling)
    a = Autoscaling(**raw)
    check.integer("deployment.autoscaling.min_replicas", a.min_replicas, 0)
    check.integer("deployment.autoscaling.max_replicas", a.max_replicas, max(1, a.min_replicas))
    if a.initial_replicas is not None:
        check.integer("deployment.autoscaling.initial_replicas", a.initial_replicas,
                      a.min_replicas, a.max_replicas)
    check.positive("deployment.autoscaling.target_ongoing_requests", a.target_ongoing_requests)
    for name in ("upscale_delay_s", "downscale_delay_s"):
        check.number(f"deployment.autoscaling.{name}", getattr(a, name), lo=0)
    for name in ("metrics_interval_s", "look_back_period_s"):
        check.positive(f"deployment.autoscaling.{name}", getattr(a, name))
    return a


def _known(section: str, raw: Mapping[str, Any], cls: type) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(map(str, raw)) - known)
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
