"""The shared value checks (pipeline.validate): one message shape, the field first."""

from __future__ import annotations

import re

import pytest

from pipeline import validate as check
from pipeline.config import load_config
from pipeline.params import SamplingParams


@pytest.mark.parametrize(("call", "message"), [
    (lambda: check.integer("n", 0, 1), "n: must be an integer >= 1, got 0"),
    (lambda: check.integer("n", 9, 0, 8), "n: must be an integer in [0, 8], got 9"),
    (lambda: check.integer("n", True, 0), "n: must be an integer >= 0, got bool"),
    (lambda: check.integer("n", "secret text", 0), "n: must be an integer >= 0, got str"),
    (lambda: check.number("x", 0, lo=0, hi=1, lo_open=True),
     "x: must be a finite number in (0, 1], got 0"),
    (lambda: check.number("x", float("nan"), lo=0), "x: must be a finite number >= 0, got nan"),
    (lambda: check.number("x", float("inf"), lo=1), "x: must be a finite number >= 1, got inf"),
    (lambda: check.positive("x", -1.5), "x: must be a finite number > 0, got -1.5"),
    (lambda: check.choice("c", "z", ("a", "b")), "c: must be one of a, b, got 'z'"),
])
def test_each_check_names_the_field_and_the_rule(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == message


def test_in_range_values_pass():
    check.integer("n", 8, 0, 8)
    check.number("x", 1, lo=0, hi=1, lo_open=True)
    check.positive("x", 1e-9)
    check.choice("c", "a", ("a", "b"))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"spec_ema_alpha": 0}, "spec_ema_alpha: must be a finite number in (0, 1], got 0"),
    ({"spec_margin": float("inf")}, "spec_margin: must be a finite number >= 1, got inf"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens: must be an integer >= 0, got -1"),
    ({"draft_agreement_noise": float("nan")}, "draft_agreement_noise: must be a finite number"),
])
def test_config_and_spec_settings_use_the_shared_checks(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, overrides)


def test_request_parameters_use_the_shared_checks():
    with pytest.raises(ValueError, match=r"^top_p: must be a finite number in \(0, 1\], got 0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"^max_new_tokens: must be an integer in \[1, \d+\], got str"):
        SamplingParams(max_new_tokens="many")
