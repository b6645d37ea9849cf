"""EngineCall, the one request object from the ingress to the engine core, and the positional
form the bench scripts still use (`as_engine_call`)."""

from __future__ import annotations

import pytest

from pipeline.params import SamplingParams
from pipeline.protocol import EngineCall, as_engine_call


def test_a_call_passes_through_unchanged():
    call = EngineCall("r", [1, 2], SamplingParams(max_new_tokens=3), "tp", "g", True, "t")
    assert as_engine_call(call) is call


def test_the_positional_form_names_the_same_call():
    p = SamplingParams(max_new_tokens=3)
    assert as_engine_call("r", [1, 2], p, last=True) == EngineCall("r", [1, 2], p, last=True)
    assert as_engine_call("r", [1], p, "tp", "g", False, "t") == \
        EngineCall("r", [1], p, traceparent="tp", group="g", tenant="t")


def test_a_call_with_more_arguments_or_no_call_is_refused():
    with pytest.raises(TypeError, match="pass nothing after it"):
        as_engine_call(EngineCall("r", [1]), [1])
    with pytest.raises(TypeError, match="expected an EngineCall, got tuple"):
        as_engine_call(("r", [1]))  # type: ignore[arg-type]


def test_an_empty_call_defaults_to_default_params_no_group_and_anonymous():
    call = EngineCall("r", [5])
    assert (call.params, call.traceparent, call.group, call.last, call.tenant) == \
        (SamplingParams(), None, None, False, "")
