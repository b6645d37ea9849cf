"""Speculation settings: the adaptive controller's knobs, defaults and ranges, below both
EngineConfig and the controller. In the config `mode` is `speculation` and other fields are
`spec_<field>` (`config_name`); errors name that key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline import validate as check

MODES = ("adaptive", "fixed")


@dataclass
class SpecSettings:
    mode: str = "adaptive"
    num_speculative_tokens: int = 4
    ema_alpha: float = 0.25
    prior: float = 0.5
    probe_every: int = 8  # steps without a verified draft before a one-draft probe
    probe_backoff: int = 8
    cost_decay: float = 0.97
    prior_weight: float = 2.0
    pool_alpha: float = 0.05
    # At batch b a draft's gain must beat 1 + (margin - 1) (b - 1) / b times its cost: its
    # verify row slows every other request of the batch.
    margin: float = 1.5


_RENAMED = {"mode": "speculation", "num_speculative_tokens": "num_speculative_tokens"}
FIELDS = tuple(f.name for f in dataclasses.fields(SpecSettings))


def config_name(field: str) -> str:
    return _RENAMED.get(field, "spec_" + field)


def validate(settings: SpecSettings) -> None:
    n = config_name
    check.choice(n("mode"), settings.mode, MODES)
    check.integer(n("num_speculative_tokens"), settings.num_speculative_tokens, 0)
    for field in ("ema_alpha", "prior", "cost_decay", "pool_alpha"):
        check.number(n(field), getattr(settings, field), lo=0, hi=1, lo_open=True)
    check.integer(n("probe_every"), settings.probe_every, 1)
    check.integer(n("probe_backoff"), settings.probe_backoff, 1)
    check.number(n("margin"), settings.margin, lo=1)
    check.number(n("prior_weight"), settings.prior_weight, lo=0)
