"""EngineCall, the one request object from the ingress to the engine core."""

from __future__ import annotations

from pipeline.params import SamplingParams
from pipeline.protocol import EngineCall


def test_an_empty_call_defaults_to_default_params_no_group_and_anonymous():
    call = EngineCall("r", [5])
    assert (call.params, call.traceparent, call.group, call.last, call.tenant) == \
        (SamplingParams(), None, None, False, "")
