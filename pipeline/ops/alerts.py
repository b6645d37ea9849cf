"""The Prometheus alert rules, as data: `rule_file()` is helm/specrelay/files/alerts.yaml, which the
chart also wraps in a PrometheusRule. Runbooks: docs/operations.md; unit tests:
tests/ops/promtool/alerts_test.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GROUP = "specrelay"
RUNBOOK = "docs/operations.md#{anchor}"

# The runbooks name these thresholds.
ACCEPTANCE_FLOOR = 0.1  # pooled verifier acceptance below this while drafting = collapse
QUEUE_FULL = 0.9  # waiting / wait-queue places
REJECTED_SHARE = 0.05  # 429s among generation requests
ERROR_SHARE = 0.05  # 5xx among API requests (not /health's 503s)

API = 'route=~"/v1/.*"'


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str  # critical: pages; warning: a ticket
    summary: str
    description: str

    def rule(self) -> dict[str, Any]:
        return {
            "alert": self.name, "expr": self.expr, "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description,
                            "runbook": RUNBOOK.format(anchor=self.name.lower())},
        }


def _rate(metric: str, window: str, by: str = "model") -> str:
    return f"sum by ({by}) (rate({metric}[{window}]))"


DRAFTED = "specrelay_spec_decode_num_draft_tokens_total"
ACCEPTED = "specrelay_spec_decode_num_accepted_tokens_total"
VERIFY_STEPS = "specrelay_spec_decode_num_verify_steps_total"
HTTP = "specrelay_http_requests_total"

ALERTS = (
    Alert("SpecrelayAcceptanceCollapse",
          f"({_rate(ACCEPTED, '10m')} / {_rate(DRAFTED, '10m')}) < {ACCEPTANCE_FLOOR}"
          f" and {_rate(DRAFTED, '10m')} > 0",
          "15m", "warning",
          "Draft acceptance of {{ $labels.model }} is {{ $value | humanizePercentage }}",
          f"Pooled verifier acceptance has stayed under {ACCEPTANCE_FLOOR:.0%} while drafting: "
          "speculation costs verify work and saves nothing; very low acceptance can also mean "
          "garbled output."),
    Alert("SpecrelaySpeculationStopped",
          f"{_rate(DRAFTED, '15m')} == 0 and {_rate(VERIFY_STEPS, '15m')} > 0"
          f" and sum by (model) (increase({DRAFTED}[6h] offset 15m)) > 0",
          "15m", "warning",
          "{{ $labels.model }} stopped drafting",
          "Requests are decoding but no draft token was proposed for 15 minutes, after drafts "
          "were proposed in the hours before: speculation silently stopped paying."),
    Alert("SpecrelayStallDetected",
          "sum by (instance, model) (increase(specrelay_engine_stall_detections_total[10m])) > 0",
          "0m", "critical",
          "Engine step stalled on {{ $labels.instance }}",
          "A step took longer than the stall bound: its in-flight requests failed and the engine "
          "rebuilt its stage actors."),
    Alert("SpecrelayQueueSaturated",
          f"sum by (model) (specrelay_num_requests_waiting) / sum by (model) "
          f"(specrelay_max_waiting) > {QUEUE_FULL}",
          "5m", "warning",
          "Wait queue of {{ $labels.model }} is {{ $value | humanizePercentage }} full",
          "Requests are waiting for engine slots and the queue is close to full; beyond it new "
          "requests get 429."),
    Alert("SpecrelayRequestsRejected",
          f'sum(rate({HTTP}{{status="429"}}[5m])) / sum(rate({HTTP}{{{API}}}[5m]))'
          f" > {REJECTED_SHARE}",
          "5m", "warning",
          "{{ $value | humanizePercentage }} of API requests get 429",
          "The servers refuse requests because every slot and queue place is taken."),
    Alert("SpecrelayServerErrors",
          f'sum(rate({HTTP}{{status=~"5..",{API}}}[5m])) / sum(rate({HTTP}{{{API}}}[5m]))'
          f" > {ERROR_SHARE}",
          "5m", "critical",
          "{{ $value | humanizePercentage }} of API requests fail with 5xx",
          "API requests end with server errors (dead or stalled engine, timeouts, bugs)."),
    Alert("SpecrelayNoHealthyEngine",
          "(sum(specrelay_engine_healthy) or vector(0)) < 1",
          "2m", "critical",
          "No specrelay server has a healthy engine",
          "Every scraped server reports its engine unhealthy, or none is scraped at all: the "
          "service cannot generate."),
)


def rule_file() -> dict[str, Any]:
    return {"groups": [{"name": GROUP, "rules": [a.rule() for a in ALERTS]}]}
