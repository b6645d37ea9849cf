"""SamplingParams owns its value rules: bad values raise ValueError naming the field (the front
end turns that into a 400 naming the user's parameter)."""

from __future__ import annotations

import pytest

from pipeline.params import SamplingParams


@pytest.mark.parametrize("temperature", [0, 0.0, 0.7, 2, 2.0])
def test_temperatures_from_0_to_2_are_accepted(temperature):
    assert SamplingParams(temperature=temperature).temperature == temperature


@pytest.mark.parametrize("temperature", [-0.1, 2.0001, 3, float("inf"), float("nan")])
def test_a_temperature_outside_0_to_2_is_refused_naming_temperature(temperature):
    with pytest.raises(ValueError, match=r"^temperature: must be"):
        SamplingParams(temperature=temperature)
