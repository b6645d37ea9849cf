"""Speculation settings: the adaptive controller's knobs, their defaults and their valid ranges.

One home for them below both users: `pipeline.config.EngineConfig` takes its `speculation` and
`spec_*` defaults from here and validates through `validate`, and the controller
(`pipeline.engine.spec`) reads a `SpecSettings`. In the config (YAML, CLI, chart) a field is
named by `config_name`: `mode` is `speculation`, `num_speculative_tokens` keeps its name, every
other field is `spec_<field>`; errors name the config key, since that is what a user wrote.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline import validate as check

MODES = ("adaptive", "fixed")


@dataclass
class SpecSettings:
    # adaptive: per request and step, k in 0..num_speculative_tokens from the request's own
    # acceptance and the measured step cost; fixed: always the most drafts allowed.
    mode: str = "adaptive"
    num_speculative_tokens: int = 4  # most drafts per request and step
    ema_alpha: float = 0.25  # weight of the newest observation in a request's per-position EMA
    prior: float = 0.5  # the pooled acceptance before any draft has been verified
    probe_every: int = 8  # steps without a verified draft before a one-draft probe
    probe_backoff: int = 8  # a rejected probe doubles the wait, up to probe_every * this
    cost_decay: float = 0.97  # per-step decay of the step-cost model's past observations
    prior_weight: float = 2.0  # observations the pooled estimate counts as in a request's own
    # weight of the newest request-step in the engine-wide EMA, and the per-step fade of its
    # evidence
    pool_alpha: float = 0.05
    # at batch b > 1 a draft's gain must beat 1 + (margin - 1) (b - 1) / b times its cost: its
    # verify row slows every other request of the batch
    margin: float = 1.5


_RENAMED = {"mode": "speculation", "num_speculative_tokens": "num_speculative_tokens"}
FIELDS = tuple(f.name for f in dataclasses.fields(SpecSettings))


def config_name(field: str) -> str:
    """The config key that sets SpecSettings field `field`."""
    return _RENAMED.get(field, "spec_" + field)


def validate(settings: SpecSettings) -> None:
    """ValueError naming the config key of the first bad field."""
    n = config_name
    check.choice(n("mode"), settings.mode, MODES)
    check.integer(n("num_speculative_tokens"), settings.num_speculative_tokens, 0)
    for field in ("ema_alpha", "prior", "cost_decay", "pool_alpha"):  # rates and decays
        check.number(n(field), getattr(settings, field), lo=0, hi=1, lo_open=True)
    check.integer(n("probe_every"), settings.probe_every, 1)
    check.integer(n("probe_backoff"), settings.probe_backoff, 1)
    check.number(n("margin"), settings.margin, lo=1)
    check.number(n("prior_weight"), settings.prior_weight, lo=0)
